//! NCCL through [`deltaserve_cuda::collective`]: without NCCL the constructor is a clear error (no
//! panic); on one GPU a single-rank all-reduce (f32 and bf16, buffers from the arena) is the identity
//! and a single-rank all-gather a copy; on 2+ GPUs a 2-rank all-reduce sums and an all-gather
//! concatenates in rank order. Tests print SKIP and pass where the hardware or library is missing.

use deltaserve_cuda::collective::{CollDtype, CollectiveError, Communicators, nccl_present, nccl_version};
use deltaserve_cuda::{Arena, DevSpan, Runtime};
use half::bf16;

fn runtime(ordinal: usize) -> Option<Runtime> {
    match Runtime::open(ordinal) {
        Ok(rt) => Some(rt),
        Err(e) => {
            println!("SKIP: no usable GPU {ordinal} ({e})");
            None
        }
    }
}

fn alloc(arena: &mut Arena, name: &str, bytes: usize) -> DevSpan {
    let region = arena.add_region(name, bytes).unwrap();
    arena.alloc(region, bytes).unwrap()
}

#[test]
fn missing_nccl_is_an_error_not_a_panic() {
    if nccl_present() {
        println!("NCCL present: version {}", nccl_version().unwrap());
        return;
    }
    let e = nccl_version().unwrap_err();
    assert!(matches!(e, CollectiveError::LibraryMissing));
    let msg = e.to_string();
    assert!(msg.contains("libnccl.so") && msg.contains("LD_LIBRARY_PATH"), "{msg}");
    println!("NCCL missing, as reported: {msg}");
    // Without a GPU (or without NCCL) no communicator can be made: an error, not a panic.
    if let Some(rt) = runtime(0) {
        let e = Communicators::new(vec![rt.stream().clone()]).err().unwrap();
        assert!(matches!(e, CollectiveError::LibraryMissing), "{e}");
    }
}

#[test]
fn single_rank_all_reduce_is_identity() {
    let Some(rt) = runtime(0) else { return };
    if !nccl_present() {
        println!("SKIP: {}", CollectiveError::LibraryMissing);
        return;
    }
    println!("NCCL version {}", nccl_version().unwrap());
    let comms = Communicators::new(vec![rt.stream().clone()]).unwrap();
    assert_eq!(comms.world(), 1);
    assert_eq!(std::env::var("NCCL_NVLS_ENABLE").as_deref(), Ok("0"));
    let n = 100_003;
    let mut arena = Arena::new(rt.context().clone());

    let host: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let buf = alloc(&mut arena, "f32", n * 4);
    rt.upload(buf.ptr, &host).unwrap();
    comms.all_reduce_sum_all(&[buf], n, CollDtype::F32).unwrap();
    comms.all_reduce_sum_rank(0, buf, n, CollDtype::F32).unwrap();
    let mut back = vec![0.0f32; n];
    rt.download(&mut back, buf.ptr).unwrap();
    assert!(back.iter().zip(&host).all(|(a, b)| a.to_bits() == b.to_bits()), "f32 all-reduce of one rank changed data");

    let hb: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
    let bb = alloc(&mut arena, "bf16", n * 2);
    rt.upload(bb.ptr, &hb).unwrap();
    comms.all_reduce_sum_all(&[bb], n, CollDtype::Bf16).unwrap();
    let mut back = vec![bf16::ZERO; n];
    rt.download(&mut back, bb.ptr).unwrap();
    assert_eq!(back, hb, "bf16 all-reduce of one rank changed data");

    // All-gather of one rank: a copy.
    let dst = alloc(&mut arena, "gather", n * 4);
    comms.all_gather_all(&[buf], &[dst], n, CollDtype::F32).unwrap();
    let mut back = vec![0.0f32; n];
    rt.download(&mut back, dst.ptr).unwrap();
    assert!(back.iter().zip(&host).all(|(a, b)| a.to_bits() == b.to_bits()));

    // Buffers too small for the count are refused before NCCL is called.
    let e = comms.all_reduce_sum_rank(0, buf, n + 1, CollDtype::F32).unwrap_err();
    assert!(e.to_string().contains("bytes"), "{e}");
    println!("single-rank NCCL all-reduce (f32, bf16) and all-gather of {n} elements: identity");
}

#[test]
fn two_rank_all_reduce_sums() {
    let Some(rt0) = runtime(0) else { return };
    if !nccl_present() {
        println!("SKIP: {}", CollectiveError::LibraryMissing);
        return;
    }
    let count = cudarc::driver::result::device::get_count().unwrap_or(0);
    if count < 2 {
        println!("SKIP: 2-rank all-reduce needs 2 GPUs, {count} visible (blocked: run on a 2-GPU machine)");
        return;
    }
    let rt1 = Runtime::open(1).unwrap();
    let comms = Communicators::new(vec![rt0.stream().clone(), rt1.stream().clone()]).unwrap();
    let n = 1 << 20;
    let (mut a0, mut a1) = (Arena::new(rt0.context().clone()), Arena::new(rt1.context().clone()));
    let h0: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let h1: Vec<f32> = (0..n).map(|i| 0.5 * (i % 777) as f32).collect();
    let (b0, b1) = (alloc(&mut a0, "x", n * 4), alloc(&mut a1, "x", n * 4));
    rt0.upload(b0.ptr, &h0).unwrap();
    rt1.upload(b1.ptr, &h1).unwrap();
    comms.all_reduce_sum_all(&[b0, b1], n, CollDtype::F32).unwrap();
    let (mut r0, mut r1) = (vec![0.0f32; n], vec![0.0f32; n]);
    rt0.download(&mut r0, b0.ptr).unwrap();
    rt1.download(&mut r1, b1.ptr).unwrap();
    let want: Vec<f32> = h0.iter().zip(&h1).map(|(a, b)| a + b).collect();
    assert_eq!(r0, want);
    assert_eq!(r1, want);

    // bf16: small integers sum exactly.
    let hb0: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i % 16) as f32)).collect();
    let hb1: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i % 8) as f32)).collect();
    rt0.upload(b0.ptr, &hb0).unwrap();
    rt1.upload(b1.ptr, &hb1).unwrap();
    comms.all_reduce_sum_all(&[b0, b1], n, CollDtype::Bf16).unwrap();
    let mut rb = vec![bf16::ZERO; n];
    rt1.download(&mut rb, b1.ptr).unwrap();
    assert!(rb.iter().enumerate().all(|(i, x)| x.to_f32() == ((i % 16) + (i % 8)) as f32));

    // All-gather: rank order.
    let half = n / 2;
    let (g0, g1) = (alloc(&mut a0, "g", n * 4), alloc(&mut a1, "g", n * 4));
    rt0.upload(b0.ptr, &h0[..half]).unwrap();
    rt1.upload(b1.ptr, &h1[..half]).unwrap();
    comms.all_gather_all(&[b0, b1], &[g0, g1], half, CollDtype::F32).unwrap();
    let mut g = vec![0.0f32; n];
    rt1.download(&mut g, g1.ptr).unwrap();
    assert_eq!(&g[..half], &h0[..half]);
    assert_eq!(&g[half..], &h1[..half]);
    println!("2-rank NCCL all-reduce (f32, bf16) and all-gather of {n} elements: correct");
}
