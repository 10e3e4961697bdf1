//! The run's SVG, drawn with `plotters`: img/s of every measured step (left) and each step's
//! phases as stacked bars in ms (right), with ticked, labelled axes and a legend below.

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::timing::{Phase, StepTimes};

/// One colour per phase, in [`Phase::ALL`] order.
const COLOURS: [RGBColor; 5] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
];

const WIDTH: u32 = 960;
const HEIGHT: u32 = 420;
/// Height of the strip under the phase chart that holds its legend.
const LEGEND_HEIGHT: u32 = 56;
/// Width of one legend entry: the longest phase name ("host_to_device") and its swatch fit.
const LEGEND_SLOT: i32 = 150;

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The SVG text of the two charts under `title`, for a README or a PR.
pub fn svg(steps: &[StepTimes], batch: usize, title: &str) -> String {
    let mut out = String::new();
    // Drawing into a string cannot fail for I/O; a plotting error leaves what was drawn.
    if let Err(e) = draw(&mut out, steps, batch, title) {
        eprintln!("chart: {e}");
    }
    out
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn draw(out: &mut String, steps: &[StepTimes], batch: usize, title: &str) -> DrawResult {
    let root = SVGBackend::with_string(out, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 16))?;
    let (left, right) = root.split_horizontally(WIDTH / 2);
    let rates: Vec<f64> = steps
        .iter()
        .map(|s| batch as f64 / s.total().as_secs_f64().max(1e-9))
        .collect();
    let top_rate = headroom(rates.iter().cloned().fold(0.0, f64::max));
    let (throughput, _) = left.split_vertically(HEIGHT - 30 - LEGEND_HEIGHT);
    let axes = Axes {
        steps: steps.len(),
        top: top_rate,
    };
    let mut chart = axes.draw(&throughput, "Throughput of each step", "img/s")?;
    chart.draw_series(LineSeries::new(
        rates.iter().enumerate().map(|(i, r)| (i as f64 + 1.0, *r)),
        COLOURS[2].stroke_width(2),
    ))?;

    let top_ms = headroom(steps.iter().map(|s| ms(s.total())).fold(0.0, f64::max));
    let (breakdown, legend) = right.split_vertically(HEIGHT - 30 - LEGEND_HEIGHT);
    let axes = Axes {
        steps: steps.len(),
        top: top_ms,
    };
    let mut chart = axes.draw(&breakdown, "Where each step's time went", "ms per step")?;
    for (i, s) in steps.iter().enumerate() {
        let x = i as f64 + 1.0;
        let mut from = 0.0;
        for (phase, colour) in Phase::ALL.iter().zip(COLOURS) {
            let to = from + ms(s.get(*phase));
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x - 0.45, from), (x + 0.45, to)],
                colour.filled(),
            )))?;
            from = to;
        }
    }

    // The legend: fixed slots, three to a row, so entries cannot run into each other.
    let label = TextStyle::from(("sans-serif", 12)).pos(Pos::new(HPos::Left, VPos::Center));
    for (k, (phase, colour)) in Phase::ALL.iter().zip(COLOURS).enumerate() {
        let (x, y) = (66 + (k as i32 % 3) * LEGEND_SLOT, 12 + (k as i32 / 3) * 20);
        legend.draw(&Rectangle::new(
            [(x, y - 5), (x + 10, y + 5)],
            colour.filled(),
        ))?;
        legend.draw(&Text::new(phase.name(), (x + 16, y), label.clone()))?;
    }
    root.present()?;
    Ok(())
}

/// A chart's frame: measured steps along x (each in a slot one wide, at 1..=steps), values from
/// 0 to `top` along y, with both axes ticked and labelled.
struct Axes {
    steps: usize,
    top: f64,
}

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

impl Axes {
    fn draw<'a, 'b>(
        &self,
        area: &'a DrawingArea<SVGBackend<'b>, Shift>,
        caption: &str,
        unit: &str,
    ) -> Result<Chart<'a, 'b>, Box<dyn std::error::Error>> {
        let slots = self.steps.max(1) as f64;
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 13))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.5..slots + 0.5, 0.0..self.top)?;
        chart
            .configure_mesh()
            .x_desc("measured step")
            .y_desc(unit)
            .x_labels(x_labels(self.steps))
            .x_label_formatter(&step_label)
            .y_label_formatter(&value_label)
            .disable_x_mesh()
            .light_line_style(WHITE)
            .draw()?;
        Ok(chart)
    }
}

/// The y axis's top: the largest value plus a tenth, so the line or bar never touches the frame
/// (1 when there is nothing to show).
fn headroom(max: f64) -> f64 {
    if max.is_finite() && max > 0.0 {
        max * 1.1
    } else {
        1.0
    }
}

/// How many step numbers the x axis gets: every step up to a dozen, else about ten.
fn x_labels(steps: usize) -> usize {
    if steps <= 12 {
        steps.max(1)
    } else {
        10
    }
}

/// A value on a y axis: whole numbers when they are, else one decimal.
fn value_label(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// Step numbers on the x axis: whole steps only.
fn step_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-9 && *x >= 1.0 {
        format!("{}", x.round() as u64)
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text of every `<text>` element, trimmed (plotters puts it on a line of its own).
    fn texts(svg: &str) -> Vec<String> {
        svg.split("</text>")
            .filter_map(|chunk| chunk.rsplit_once('>').map(|(_, t)| t.trim().to_string()))
            .filter(|t| !t.is_empty())
            .collect()
    }

    #[test]
    fn the_charts_have_titles_units_ticks_bars_and_a_legend() {
        let steps = [
            StepTimes::from_ms([1, 2, 3, 4, 5]),
            StepTimes::from_ms([5, 4, 3, 2, 1]),
        ];
        let svg = svg(&steps, 8, "a <test>");
        assert!(
            svg.starts_with("<svg") && svg.contains("a &lt;test&gt;"),
            "{svg}"
        );
        let texts = texts(&svg);
        let count = |t: &str| texts.iter().filter(|x| *x == t).count();
        // Units on both value axes, the step axis under each chart, the captions.
        for text in ["img/s", "ms per step", "Throughput of each step"] {
            assert_eq!(count(text), 1, "{text} in {texts:?}");
        }
        assert_eq!(count("measured step"), 2, "{texts:?}");
        // Every phase named once, in the legend.
        for phase in Phase::ALL {
            assert_eq!(count(phase.name()), 1, "{texts:?}");
        }
        // Step numbers on both x axes; round values up past the 15 ms step on the ms axis.
        assert!(count("1") == 2 && count("2") >= 2, "{texts:?}");
        for text in ["0", "14", "500"] {
            assert!(count(text) >= 1, "{text} missing from {texts:?}");
        }
        // 2 steps × 5 phases of bars, 5 legend swatches, the backgrounds.
        assert!(svg.matches("<rect").count() >= 10 + 5, "{svg}");
        assert_eq!(step_label(&1.5), "");
        assert_eq!(step_label(&3.0), "3");
    }

    #[test]
    fn no_steps_or_zero_times_still_draw() {
        assert!(texts(&svg(&[], 8, "empty")).contains(&"img/s".to_string()));
        let zeros = texts(&svg(&[StepTimes::from_ms([0; 5])], 8, "zeros"));
        assert!(zeros.contains(&"ms per step".to_string()), "{zeros:?}");
    }
}
