//! Fixtures the checkpoint room's own unit tests share (`cfg(test)`); the GPU, scratch paths
//! and random bytes come from the storage room's (`crate::storage::testkit`).

use std::path::{Path, PathBuf};

use rand::{RngCore, SeedableRng};

/// Buffers of `lens` random bytes, filled in turn from one generator seeded with `seed`.
pub(crate) fn random_tensors(lens: &[usize], seed: u64) -> Vec<Vec<u8>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    lens.iter()
        .map(|&n| {
            let mut v = vec![0u8; n];
            rng.fill_bytes(&mut v);
            v
        })
        .collect()
}

/// Writes a checkpoint of one `U8` tensor per `(name, bytes)` at `path`, with the
/// `safetensors` crate's writer.
pub(crate) fn write_u8_tensors<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (String, &'a [u8])>,
) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .into_iter()
        .map(|(name, d)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![d.len()], d)
                    .unwrap();
            (name, view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// `tensors` as a checkpoint `gpudirect-{name}-{pid}.safetensors` in the test directory, each
/// buffer a `U8` tensor named `t0`, `t1`, …: its path.
pub(crate) fn u8_checkpoint(name: &str, tensors: &[Vec<u8>]) -> PathBuf {
    let path = crate::storage::testkit::scratch(name).with_extension("safetensors");
    write_u8_tensors(
        &path,
        tensors
            .iter()
            .enumerate()
            .map(|(i, d)| (format!("t{i}"), d.as_slice())),
    );
    path
}
