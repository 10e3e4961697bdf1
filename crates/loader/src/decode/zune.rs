//! zune-jpeg: the pure-Rust codec. It has no DCT scaling or cropped decoding, so it decodes the
//! whole image at full size and the crop is taken afterwards.

use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use super::{DecodeError, Placed, Region, MAX_SIDE};

pub(super) fn decode(
    bytes: &[u8],
    plan: &mut dyn FnMut(usize, usize) -> Region,
    buffer: &mut Vec<u8>,
) -> Result<Placed, DecodeError> {
    let options = DecoderOptions::new_fast()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_max_width(MAX_SIDE)
        .set_max_height(MAX_SIDE);
    let mut decoder = JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    decoder
        .decode_headers()
        .map_err(|e| DecodeError(format!("header: {e:?}")))?;
    let (width, height) = decoder
        .dimensions()
        .ok_or_else(|| DecodeError("no dimensions".into()))?;
    let len = decoder
        .output_buffer_size()
        .ok_or_else(|| DecodeError("output size unknown".into()))?;
    if len != width * height * 3 {
        return Err(DecodeError(format!(
            "decodes to {len} bytes, not RGB {width}x{height}"
        )));
    }
    buffer.resize(len, 0);
    decoder
        .decode_into(&mut buffer[..len])
        .map_err(|e| DecodeError(format!("data: {e:?}")))?;
    Ok(Placed::whole(width, height, plan(width, height)))
}
