//! The tensor front end on the reference device: views, errors, autograd semantics, uploads.

use redline_hostmem::BufferPool;
use redline_tensor::{no_grad, DType, Device, HostBytes, Tensor, TensorError};

fn t(values: &[f64], shape: &[usize], dev: &Device) -> Tensor {
    Tensor::from_slice(values, shape, dev).unwrap()
}

#[test]
fn views_share_storage_and_read_correctly() {
    let dev = Device::reference();
    let x = t(&[0., 1., 2., 3., 4., 5.], &[2, 3], &dev);
    let xt = x.transpose(0, 1).unwrap();
    assert_eq!(xt.shape(), [3, 2]);
    assert_eq!(xt.to_f64_vec().unwrap(), [0., 3., 1., 4., 2., 5.]);
    assert!(std::sync::Arc::ptr_eq(x.storage(), xt.storage()));
    assert_eq!(
        x.narrow(1, 1, 2).unwrap().to_f64_vec().unwrap(),
        [1., 2., 4., 5.]
    );
    let b = t(&[1., 2., 3.], &[3], &dev).broadcast_to(&[2, 3]).unwrap();
    assert_eq!(b.to_f64_vec().unwrap(), [1., 2., 3., 1., 2., 3.]);
    // A transposed view reshaped needs a copy, and still reads right.
    assert_eq!(
        xt.reshape(&[6]).unwrap().to_f64_vec().unwrap(),
        [0., 3., 1., 4., 2., 5.]
    );
}

#[test]
fn channels_last_is_kept_through_elementwise_ops() {
    let dev = Device::reference();
    let values: Vec<f64> = (0..24).map(f64::from).collect();
    let x = t(&values, &[1, 2, 3, 4], &dev);
    let cl = x.to_channels_last().unwrap();
    assert!(cl.is_channels_last());
    assert_eq!(
        cl.to_f64_vec().unwrap(),
        values,
        "logical order is unchanged"
    );
    let y = cl.relu().unwrap().add(&cl).unwrap();
    assert!(y.is_channels_last());
    assert_eq!(
        y.to_f64_vec().unwrap(),
        values.iter().map(|v| 2.0 * v).collect::<Vec<_>>()
    );
}

#[test]
fn mixing_dtypes_devices_and_shapes_is_a_readable_error() {
    let (a, b) = (Device::reference(), Device::reference());
    let x = t(&[1., 2.], &[2], &a);
    let y32 = Tensor::from_slice(&[1.0f32, 2.0], &[2], &a).unwrap();
    let err = x.add(&y32).unwrap_err();
    assert!(matches!(err, TensorError::DType(_)));
    assert!(
        err.to_string().contains("f64 [2]") && err.to_string().contains("f32 [2]"),
        "{err}"
    );
    let err = x.add(&t(&[1., 2.], &[2], &b)).unwrap_err();
    assert!(matches!(err, TensorError::Device(_)), "{err}");
    let err = x.add(&t(&[1., 2., 3.], &[3], &a)).unwrap_err().to_string();
    assert!(err.contains("[2]") && err.contains("[3]"), "{err}");
    let err = x.matmul(&x).unwrap_err().to_string();
    assert!(err.contains("matmul"), "{err}");
    assert!(Tensor::from_slice(&[1.0f32; 3], &[2, 2], &a).is_err());
}

#[test]
fn undeclared_pairs_are_refused_by_name() {
    let dev = Device::reference();
    let ints = Tensor::from_slice(&[1i32, 2], &[2], &dev).unwrap();
    let err = ints.exp().unwrap_err();
    assert!(matches!(err, TensorError::Unsupported { .. }));
    assert_eq!(
        err.to_string(),
        "reference does not support exp on i32 (see its declared op/dtype matrix)"
    );
    // What integers do support works.
    assert_eq!(ints.add(&ints).unwrap().to_vec::<i32>().unwrap(), [2, 4]);
}

#[test]
fn gradients_accumulate_across_backward_calls_and_clear() {
    let dev = Device::reference();
    let x = t(&[1., 2.], &[2], &dev).with_requires_grad(true);
    for _ in 0..2 {
        x.mul_scalar(3.0)
            .unwrap()
            .sum(&[], false)
            .unwrap()
            .backward()
            .unwrap();
    }
    assert_eq!(x.grad().unwrap().to_f64_vec().unwrap(), [6., 6.]);
    x.zero_grad();
    assert!(x.grad().is_none());
}

#[test]
fn a_tensor_used_twice_gets_both_contributions() {
    let dev = Device::reference();
    let x = t(&[3.], &[1], &dev).with_requires_grad(true);
    let y = x.mul(&x).unwrap().add(&x).unwrap(); // x² + x → 2x + 1 = 7
    y.sum(&[], false).unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_f64_vec().unwrap(), [7.]);
}

#[test]
fn a_channels_last_leaf_gets_a_channels_last_gradient() {
    // Used twice, so its gradient is shared and must be copied: in the leaf's own memory order
    // (PyTorch's layout contract), not transposed to row-major.
    let dev = Device::reference();
    let values: Vec<f64> = (0..2 * 3 * 2 * 2).map(|i| i as f64).collect();
    let x = t(&values, &[2, 3, 2, 2], &dev)
        .to_channels_last()
        .unwrap()
        .with_requires_grad(true);
    x.add(&x)
        .unwrap()
        .sum(&[], false)
        .unwrap()
        .backward()
        .unwrap();
    let g = x.grad().unwrap();
    assert!(
        g.is_channels_last(),
        "gradient strides {:?}",
        g.layout().strides()
    );
    assert_eq!(g.to_f64_vec().unwrap(), vec![2.0; values.len()]);
}

#[test]
fn no_grad_and_detach_stop_the_tape() {
    let dev = Device::reference();
    let x = t(&[1., 2.], &[2], &dev).with_requires_grad(true);
    let y = no_grad(|| x.mul(&x).unwrap());
    assert!(!y.requires_grad());
    assert!(!x.detach().requires_grad());
    let err = y.sum(&[], false).unwrap().backward().unwrap_err();
    assert!(matches!(err, TensorError::Autograd(_)), "{err}");
}

#[test]
fn the_graph_is_freed_after_backward() {
    let dev = Device::reference();
    let x = t(&[1., 2.], &[2], &dev).with_requires_grad(true);
    let loss = x.exp().unwrap().sum(&[], false).unwrap();
    loss.backward().unwrap();
    let err = loss.backward().unwrap_err().to_string();
    assert!(err.contains("already freed"), "{err}");
    let err = x.exp().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("one-element"), "{err}");
}

#[test]
fn uploads_return_pooled_buffers_when_the_copy_is_done() {
    let dev = Device::reference();
    let pool = BufferPool::page_aligned(1, 16).unwrap();
    let mut buffer = pool.acquire().unwrap();
    buffer[..4].copy_from_slice(&[1, 2, 3, 4]);
    let x = Tensor::upload(
        HostBytes::Pooled(std::sync::Arc::new(buffer), 0..4),
        DType::U8,
        &[4],
        &dev,
    )
    .unwrap();
    dev.synchronize().unwrap();
    assert_eq!(
        pool.stats().available,
        1,
        "the buffer is back once the copy completed"
    );
    assert_eq!(x.to_vec::<u8>().unwrap(), [1, 2, 3, 4]);
}

#[test]
fn concat_stack_and_argmax() {
    let dev = Device::reference();
    let a = t(&[1., 2.], &[1, 2], &dev).with_requires_grad(true);
    let b = t(&[3., 4., 5., 6.], &[2, 2], &dev);
    let c = Tensor::concat(&[&a, &b], 0).unwrap();
    assert_eq!(c.to_f64_vec().unwrap(), [1., 2., 3., 4., 5., 6.]);
    c.mul(&c)
        .unwrap()
        .sum(&[], false)
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(a.grad().unwrap().to_f64_vec().unwrap(), [2., 4.]);
    let s = Tensor::stack(&[&b, &b], 0).unwrap();
    assert_eq!(s.shape(), [2, 2, 2]);
    let m = t(&[1., 9., 3., 7., 2., 8.], &[2, 3], &dev);
    assert_eq!(m.argmax(1, false).unwrap().to_vec::<i64>().unwrap(), [1, 2]);
    assert_eq!(m.argmax(1, false).unwrap().dtype(), DType::I64);
}

#[test]
fn an_async_download_reads_what_a_download_reads() {
    // The reference runs ops at once, so the default `download_async` copies eagerly; the wgpu
    // suite checks a truly asynchronous one.
    let dev = Device::reference();
    let x = t(&[0., 1., 2., 3., 4., 5.], &[2, 3], &dev);
    let pending = x.transpose(0, 1).unwrap().to_vec_async::<f32>().unwrap();
    let y = x.mul_scalar(3.0).unwrap();
    assert_eq!(pending.wait().unwrap(), [0., 3., 1., 4., 2., 5.]);
    assert_eq!(
        y.to_vec_async::<i64>().unwrap().wait().unwrap(),
        [0, 3, 6, 9, 12, 15]
    );
}

/// An optimizer's device scalars are one-element float tensors of any float dtype; an integer
/// step or flag is refused by name (a backend might read it as a float).
#[test]
fn optimizer_scalars_must_be_one_element_floats() {
    use redline_tensor::{optim, SgdParams};
    let dev = Device::reference();
    let p = t(&[1., 2.], &[2], &dev);
    let g = t(&[0.5, 0.5], &[2], &dev);
    let f32_one = Tensor::full(1.0, &[1], DType::F32, &dev).unwrap();
    let hp = SgdParams {
        lr_scale: 1.0,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    let int_step = Tensor::full(0.0, &[1], DType::I64, &dev).unwrap();
    let err = optim::sgd(&[&p], &[&g], &[], &int_step, &f32_one, &hp, None).unwrap_err();
    assert!(
        err.to_string()
            .contains("sgd: step must be a float tensor, got i64"),
        "{err}"
    );
    let two = Tensor::full(1.0, &[2], DType::F32, &dev).unwrap();
    let err = optim::unscale_check(&[&g], &two, &f32_one).unwrap_err();
    assert!(
        err.to_string().contains("inv_scale must be a one-element"),
        "{err}"
    );
    // An f32 step, rate and flag beside f64 parameters are fine.
    let zero = Tensor::full(0.0, &[1], DType::F32, &dev).unwrap();
    optim::sgd(&[&p], &[&g], &[], &zero, &f32_one, &hp, Some(&zero)).unwrap();
    assert_eq!(p.to_f64_vec().unwrap(), [0.5, 1.5]);
}
