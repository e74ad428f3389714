//! Exact hot-neuron placement (`plan::placement`) of a Llama-2-70B-shaped FFN: 80 layers ×
//! 28672 neurons with power-law impacts, f16 rows (3 × 8192 × 2 bytes per neuron), 20 GiB of
//! device memory. PowerInfer gives its ILP solver 30 s for this; the goal here is under 1 s.

use criterion::{Criterion, criterion_group, criterion_main};
use gpu_offload::plan::placement::{PlacementLayer, min_gpu_neurons, place_hot_neurons};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::hint::black_box;

const LAYERS: usize = 80;
const NEURONS: usize = 28672;
const BYTES_PER_NEURON: u64 = 3 * 8192 * 2;
const BUDGET: u64 = 20 << 30;

fn seventy_b() -> Vec<PlacementLayer> {
    let mut rng = StdRng::seed_from_u64(70);
    (0..LAYERS)
        .map(|_| {
            let exponent = rng.random_range(0.8..1.4);
            PlacementLayer {
                impacts: (0..NEURONS)
                    .map(|_| (rng.random_range(1..=NEURONS) as f64).powf(-exponent))
                    .collect(),
                bytes_per_neuron: BYTES_PER_NEURON,
                min_neurons: min_gpu_neurons(4e-7, 2e-8, rng.random_range(2e-5..2e-4), NEURONS),
            }
        })
        .collect()
}

fn placement(c: &mut Criterion) {
    let layers = seventy_b();
    let mut group = c.benchmark_group("placement");
    group.sample_size(10);
    group.bench_function("70b_20gib", |b| {
        b.iter(|| place_hot_neurons(black_box(&layers), BUDGET).expect("feasible"))
    });
    group.finish();
}

criterion_group!(benches, placement);
criterion_main!(benches);
