//! Host <-> device transfers of every dtype, and buffer metadata.

mod common;

use common::*;
use tpu_dynamo_runtime::*;

#[test]
fn round_trip_every_dtype_bit_exact() {
    let client = client(2);
    let mut rng = Rng::new(6);
    for device in client.devices() {
        for dtype in DType::ALL {
            let spec = TensorSpec::new(dtype, [3, 5, 2]);
            let mut data = rng.bytes(spec.byte_size().unwrap());
            if dtype == DType::Bool {
                // PRED holds 0 or 1; other bytes need not survive.
                data.iter_mut().for_each(|b| *b &= 1);
            }
            let buffer = client.buffer_from_host(&data, &spec, &device).unwrap();
            // The caller may scribble over its data as soon as the upload returns.
            let expected = std::mem::replace(&mut data, vec![0xAB; spec.byte_size().unwrap()]);
            assert_eq!(*buffer.spec().unwrap(), spec);
            assert_eq!(buffer.device().unwrap(), device);
            assert!(buffer.on_device_size().unwrap() >= expected.len());
            let mut back = vec![0u8; expected.len()];
            buffer.to_host(&mut back).unwrap();
            assert_eq!(back, expected, "{dtype:?} on {device:?}");
        }
    }
}

#[test]
fn scalars_and_empty_tensors() {
    let client = client(1);
    let dev = &client.devices()[0];
    let scalar = upload(&client, &[std::f32::consts::PI], &[], dev);
    assert_eq!(scalar.spec().unwrap().dims, Vec::<i64>::new());
    assert_eq!(download(&scalar), vec![std::f32::consts::PI]);
    let empty = client
        .buffer_from_host(&[], &f32_spec(&[0, 7]), dev)
        .unwrap();
    assert_eq!(*empty.spec().unwrap(), f32_spec(&[0, 7]));
    empty.to_host(&mut []).unwrap();
}

#[test]
fn size_mismatches_are_rejected() {
    let client = client(1);
    let dev = &client.devices()[0];
    let buffer = upload(&client, &Rng::new(7).f32s(6), &[2, 3], dev);
    for len in [0, 23, 25, 48] {
        let err = buffer.to_host(&mut vec![0u8; len]).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("24")),
            "{err}"
        );
    }
    let err = client
        .buffer_from_host(&[0u8; 10], &f32_spec(&[2, 3]), dev)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let err = client
        .buffer_from_host(&[], &f32_spec(&[-1]), dev)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // A device of another client is refused.
    let other = client_device_of_other_client();
    let err = client
        .buffer_from_host(&[0u8; 4], &f32_spec(&[1]), &other)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

fn client_device_of_other_client() -> Device {
    client(1).devices().remove(0)
}

/// 64 bytes of `f32`s, aligned as XLA's CPU client asks of memory it takes in place (and as
/// torch's CPU allocator aligns tensors).
#[repr(C, align(64))]
struct Line([f32; 16]);

/// `values` (a multiple of 16) in 64-byte aligned memory.
fn aligned(values: &[f32]) -> Vec<Line> {
    values.chunks_exact(16).map(|c| Line(c.try_into().unwrap())).collect()
}

#[test]
fn a_buffer_over_host_memory_uses_it_in_place_where_aligned() {
    let client = client(1);
    let dev = &client.devices()[0];
    let spec = f32_spec(&[256, 64]);
    let values = Rng::new(9).f32s(256 * 64);
    let mut host = aligned(&values);
    // SAFETY: `host` is 65536 plain bytes, viewed as bytes while nothing else touches it.
    let bytes = unsafe { std::slice::from_raw_parts(host.as_mut_ptr().cast::<u8>(), 256 * 64 * 4) };
    // SAFETY: `host` outlives the buffer and is not written while an execute takes it.
    let buffer = unsafe { client.buffer_over_host(bytes, &spec, dev) }.unwrap();
    assert_eq!(download(&buffer), values);
    assert_eq!(
        buffer.host_address(&spec),
        Some(bytes.as_ptr() as usize),
        "the CPU plugin copied instead of using the host memory"
    );
    assert_eq!(buffer.host_address(&f32_spec(&[16])), None, "a type of another size is not this buffer's");
    // Misaligned memory is copied, so the buffer is still right.
    let unaligned = &bytes[4..4 + 255 * 64 * 4];
    let copied = unsafe { client.buffer_over_host(unaligned, &f32_spec(&[255, 64]), dev) }.unwrap();
    assert_eq!(download(&copied), values[1..1 + 255 * 64]);
    drop((buffer, copied));
}

#[test]
fn a_view_of_device_memory_reads_it_where_it_is_and_reports_its_address() {
    // On the CPU plugin "device memory" is the host's: the view must be the memory itself, as a
    // CUDA tensor's is on a GPU plugin (that half runs on a GPU: tests/test_on_device.py).
    let client = client(1);
    let dev = &client.devices()[0];
    let spec = f32_spec(&[8, 16]);
    let values = Rng::new(11).f32s(8 * 16);
    let host = aligned(&values);
    let address = host.as_ptr() as usize;
    // SAFETY: `host` outlives the view and is not written while it lives.
    let view = unsafe { client.view_of_device_memory(address, &spec, dev) }.unwrap();
    assert_eq!(download(&view), values);
    assert_eq!(view.device_address().unwrap(), address);
    assert!(view.dense_row_major(8 * 16 * 4));
    assert!(!view.dense_row_major(4), "a size other than the buffer's");
    drop(view);
    drop(host);
}
