//! What a program costs on the device beyond its arena: the libraries'
//! handles, streams and recorded graphs that admission does not count. A
//! packed deployment holds a thousand programs, so this must stay small.

use super::*;

/// Device bytes in use now.
fn used() -> u64 {
    let (free, total) = lanes::exec::cuda::memory_info().unwrap();
    total - free
}

/// 48 tiny ResNets (convolutions, inference batch norms, a matrix product),
/// each run three times (warm-up, profiled, recorded into a CUDA graph):
/// the device memory they take beyond their arenas' mapped bytes is at
/// most 4 MiB a program. Prints what a cuBLAS handle, a cuDNN handle and
/// a stream take alone, for the record.
#[test]
#[ignore = "needs a GPU"]
fn a_program_costs_little_beyond_its_arena() {
    const N: usize = 48;
    let built = models::resnet(&[1, 1, 1, 1], 2, 32).unwrap();
    let vg = validate(built.graph, &large_limits()).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    let (name, ty) = &built.inputs[0];
    let feeds: BTreeMap<String, Tensor> =
        [(name.clone(), rnd(&mut rng, &ty.shape.0, -1.0, 1.0))].into();
    let fetches = vec![built.output.clone()];
    // The process's first program opens the device and the libraries.
    let mut first = CudaProgram::new(vg.clone(), built.vars.clone()).unwrap();
    first.run(&feeds, &fetches).unwrap();
    let before = used();
    let mut programs = Vec::with_capacity(N);
    for _ in 0..N {
        let mut p = CudaProgram::new(vg.clone(), built.vars.clone()).unwrap();
        for _ in 0..3 {
            p.run(&feeds, &fetches).unwrap();
        }
        programs.push(p);
    }
    let after = used();
    let arenas: u64 = programs.iter().map(|p| p.own_device_bytes() as u64).sum();
    let beyond = (after - before).saturating_sub(arenas) / N as u64;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "{N} programs: {:.1} MiB in use, {:.1} MiB mapped by their arenas; \
         beyond the arena {:.2} MiB a program (graph recorded: {})",
        mib(after - before),
        mib(arenas),
        mib(beyond),
        programs[0].uses_cuda_graph()
    );
    // The parts alone, for the record.
    let ctx = cudarc::driver::CudaContext::new(lanes::exec::cuda::selected_device()).unwrap();
    let at = used();
    let streams: Vec<_> = (0..N).map(|_| ctx.new_stream().unwrap()).collect();
    let s = used();
    let blas: Vec<_> = (0..N)
        .map(|_| cudarc::cublas::CudaBlas::new(streams[0].clone()).unwrap())
        .collect();
    let b = used();
    let dnn: Vec<_> = (0..N)
        .map(|_| cudarc::cudnn::Cudnn::new(streams[0].clone()).unwrap())
        .collect();
    let d = used();
    println!(
        "alone, each: a stream {:.2} MiB, a cuBLAS handle {:.2} MiB, a cuDNN handle {:.2} MiB",
        mib((s - at) / N as u64),
        mib((b - s) / N as u64),
        mib((d - b) / N as u64)
    );
    drop((dnn, blas, streams));
    assert!(
        beyond <= 4 << 20,
        "{:.2} MiB a program beyond its arena",
        mib(beyond)
    );
}

/// A program's host image goes back to the pool when it ends, and the next
/// program of the same size takes it (no new page-locked memory): that
/// program's switches still bring back its own weights. Two tiny ResNets
/// of one architecture and different weights: the second's output after
/// an eviction equals its resident output bit for bit and differs from
/// the first's.
#[test]
#[ignore = "needs a GPU"]
fn a_reused_host_image_holds_the_new_programs_weights() {
    let a = models::resnet(&[1, 1, 1, 1], 2, 32).unwrap();
    let vg = validate(a.graph, &large_limits()).unwrap();
    // The same architecture with other weights: every variable scaled.
    let other: VarValues = a
        .vars
        .iter()
        .map(|(n, t)| {
            let v: Vec<f32> = t.f32s().unwrap().iter().map(|x| x * 0.5 + 0.01).collect();
            (n.clone(), Tensor::from_f32(t.shape().clone(), v).unwrap())
        })
        .collect();
    let mut rng = StdRng::seed_from_u64(9);
    let (name, ty) = &a.inputs[0];
    let feeds: BTreeMap<String, Tensor> =
        [(name.clone(), rnd(&mut rng, &ty.shape.0, -1.0, 1.0))].into();
    let fetches = vec![a.output.clone()];
    let run = |p: &mut Program| p.run(&feeds, &fetches).unwrap()[0].f32s().unwrap().to_vec();

    let mut first = Program::new(Backend::Cuda, vg.clone(), a.vars.clone()).unwrap();
    first.prepare_standby().unwrap();
    let first_out = run(&mut first);
    first.evict().unwrap();
    let kept_before = lanes::exec::cuda::kept_host_image_bytes();
    drop(first);
    let kept = lanes::exec::cuda::kept_host_image_bytes();
    assert!(
        kept > kept_before,
        "the image was not kept: {kept_before} → {kept}"
    );

    let mut second = Program::new(Backend::Cuda, vg, other).unwrap();
    second.prepare_standby().unwrap();
    assert!(
        lanes::exec::cuda::kept_host_image_bytes() < kept,
        "the second program did not take the kept image"
    );
    let resident = run(&mut second);
    second.evict().unwrap();
    let switched = run(&mut second);
    assert_eq!(resident, switched, "the switch brought back other weights");
    assert_ne!(
        resident, first_out,
        "the two programs' weights did not differ"
    );
}

/// The shared handles outlive every program's stream: a program runs
/// (binding both handles to its stream), another stream is made so that
/// the next program's stream cannot take the first one's address, the
/// first program goes, and the next program plans its convolutions and
/// runs, matching the first one's output. Before `handles::release`, the
/// handles stayed bound to the destroyed stream and the service crashed
/// inside libcuda (an inference load beside a running training job).
#[test]
#[ignore = "needs a GPU"]
fn the_handles_outlive_a_dropped_programs_stream() {
    let built = models::resnet(&[1, 1, 1, 1], 2, 32).unwrap();
    let vg = validate(built.graph, &large_limits()).unwrap();
    let mut rng = StdRng::seed_from_u64(6);
    let (name, ty) = &built.inputs[0];
    let feeds: BTreeMap<String, Tensor> =
        [(name.clone(), rnd(&mut rng, &ty.shape.0, -1.0, 1.0))].into();
    let fetches = vec![built.output.clone()];
    let mut first = CudaProgram::new(vg.clone(), built.vars.clone()).unwrap();
    let want = first.run(&feeds, &fetches).unwrap();
    let ctx = cudarc::driver::CudaContext::new(lanes::exec::cuda::selected_device()).unwrap();
    let mut plugs = Vec::new();
    drop(first);
    // Streams that take the freed one's place.
    for _ in 0..4 {
        plugs.push(ctx.new_stream().unwrap());
    }
    for round in 0..3 {
        let mut next = CudaProgram::new(vg.clone(), built.vars.clone()).unwrap();
        for _ in 0..3 {
            let got = next.run(&feeds, &fetches).unwrap();
            assert_eq!(got, want, "round {round}");
        }
        drop(next);
        plugs.push(ctx.new_stream().unwrap());
    }
    println!("ok   programs after a dropped one's stream: outputs equal");
}
