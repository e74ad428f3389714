//! Quantize a float GGUF (f32/f16/bf16 matrices) into a block-format GGUF, as `llama-quantize`
//! does: every matrix (`*.weight`, two dimensions) in the mix's format by llama.cpp's reference
//! quantizers ([`crate::tensor::quantize_row`], byte-equal to ggml's), every other tensor and all
//! metadata copied, `general.file_type` set to the mix. The file is written atomically, so
//! llama.cpp and this runtime can run the same bytes. Used by `convert --quantize`.

use std::path::Path;

use rayon::prelude::*;

use super::ModelError;
use super::ggml::GgmlType;
use super::gguf::{GgufFile, MetaValue, TensorSpec, write_streamed};
use super::quant_mix::QuantMix;
use crate::tensor::{DType, decode_row, quantize_row};

/// What a quantization wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizeReport {
    pub tensors: usize,
    /// Matrices quantized, by format.
    pub quantized: Vec<(DType, usize)>,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// Whether tensor `name` with GGML dims `dims` is a matrix `llama-quantize` would quantize.
fn is_matrix(name: &str, dims: &[u64]) -> bool {
    // A stack of experts' matrices (3-D) is quantized row by row like one matrix.
    name.ends_with(".weight") && dims.len() >= 2 && dims[1..].iter().product::<u64>() > 1
}

/// Quantize `src` (a GGUF whose matrices are f32, f16 or bf16) into `out` with `mix`. A model
/// that already holds block-format matrices is refused (quantizing twice compounds the error;
/// quantize from the float model), as is a tensor type with no decoder.
pub fn quantize_gguf(
    src: &Path,
    out: &Path,
    mix: QuantMix,
    force: bool,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<QuantizeReport, ModelError> {
    let bad = |path: &Path, msg: String| ModelError::Config {
        path: path.to_path_buf(),
        msg,
    };
    if out.exists() && !force {
        return Err(bad(
            out,
            "already exists (pass --force to replace it)".into(),
        ));
    }
    if src.canonicalize().ok() == out.canonicalize().ok() && out.exists() {
        return Err(bad(out, "is the model being quantized".into()));
    }
    let file = GgufFile::open(src)?;
    let arch = file.metadata.str("general.architecture")?.to_string();
    let n_layers = file.metadata.usize(&format!("{arch}.block_count"))?;
    let experts = file
        .metadata
        .opt_usize(&format!("{arch}.expert_count"))?
        .unwrap_or(0);
    // Tensors in file order, each with the format it is written in.
    let mut infos: Vec<_> = file.tensors.values().collect();
    infos.sort_by_key(|t| t.offset);
    let mut plan = Vec::with_capacity(infos.len());
    for t in &infos {
        let from = t.ggml_type.host_dtype().ok_or_else(|| {
            bad(
                src,
                format!(
                    "tensor `{}` is {}, which this runtime cannot decode",
                    t.name,
                    t.ggml_type.name()
                ),
            )
        })?;
        let to = if is_matrix(&t.name, &t.dims) {
            if from.is_quantized() {
                return Err(bad(
                    src,
                    format!(
                        "already quantized (tensor `{}` is {from}): quantize from the f16/f32 model",
                        t.name
                    ),
                ));
            }
            mix.format(&t.name, t.dims[0] as usize, n_layers, experts)
                .unwrap_or(from)
        } else {
            from
        };
        plan.push((from, to));
    }
    let specs: Vec<TensorSpec> = infos
        .iter()
        .zip(&plan)
        .map(|(t, &(from, to))| TensorSpec {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ggml_type: GgmlType::of_dtype(to).1,
            bytes: if from == to {
                t.n_bytes as u64
            } else {
                let cols = t.dims[0] as usize;
                (t.n_elements() as usize / cols * to.bytes_for(cols)) as u64
            },
        })
        .collect();
    // All metadata but the alignment (the writer aligns to 32) and the file type (now the mix's).
    let mut metadata: Vec<(&str, MetaValue)> = file
        .metadata
        .entries
        .iter()
        .filter(|(k, _)| k.as_str() != "general.alignment" && k.as_str() != "general.file_type")
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    metadata.push(("general.file_type", MetaValue::U32(mix.file_type())));
    let total: u64 = specs.iter().map(|s| s.bytes).sum();
    let mut done = 0u64;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
    }
    write_streamed(out, &metadata, &specs, &mut |i| {
        let (t, (from, to)) = (infos[i], plan[i]);
        let bytes = file.tensor_bytes(t);
        let data = if from == to {
            bytes.to_vec()
        } else {
            let cols = t.dims[0] as usize;
            let (rb_in, rb_out) = (from.bytes_for(cols), to.bytes_for(cols));
            let mut q = vec![0u8; bytes.len() / rb_in * rb_out];
            q.par_chunks_mut(rb_out)
                .zip(bytes.par_chunks(rb_in))
                .for_each(|(o, row)| {
                    let mut x = vec![0f32; cols];
                    decode_row(from, row, &mut x);
                    quantize_row(to, &x, o);
                });
            q
        };
        done += data.len() as u64;
        progress(done, total);
        Ok(data)
    })
    .map_err(|e| ModelError::io(out, e))?;
    let mut quantized: Vec<(DType, usize)> = Vec::new();
    for &(from, to) in &plan {
        if from != to {
            match quantized.iter_mut().find(|(d, _)| *d == to) {
                Some((_, n)) => *n += 1,
                None => quantized.push((to, 1)),
            }
        }
    }
    Ok(QuantizeReport {
        tensors: infos.len(),
        quantized,
        bytes_in: infos.iter().map(|t| t.n_bytes as u64).sum(),
        bytes_out: total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synth::{SynthSpec, synthesize_gguf};

    fn tiny() -> SynthSpec {
        // Rows of 256 values (K-quant super-blocks) and of 64 (falling back as llama.cpp does).
        let mut s = SynthSpec::preset("tiny").unwrap();
        s.n_layers = 3;
        s.d_model = 256;
        s.d_ff = 512;
        s.vocab_size = 320;
        s
    }

    /// `convert --quantize q4_k_m` of an f16 synth GGUF writes the same bytes as synthesizing the
    /// Q4_K_M file directly (both are llama.cpp's reference quantizers over the same f16
    /// values), and the file type says Q4_K_M.
    #[test]
    fn quantizing_the_f16_file_equals_synthesizing_the_quantized_one() {
        let dir = tempfile::tempdir().unwrap();
        let (f16_path, direct, ours) = (
            dir.path().join("m-f16.gguf"),
            dir.path().join("direct.gguf"),
            dir.path().join("ours.gguf"),
        );
        let s = tiny();
        synthesize_gguf(&s, &f16_path, false, None, &mut |_, _| {}).unwrap();
        synthesize_gguf(&s, &direct, false, Some(QuantMix::Q4KM), &mut |_, _| {}).unwrap();
        let r = quantize_gguf(&f16_path, &ours, QuantMix::Q4KM, false, &mut |_, _| {}).unwrap();
        assert!(r.bytes_out < r.bytes_in / 3, "{r:?}");
        let (a, b) = (
            GgufFile::open(&direct).unwrap(),
            GgufFile::open(&ours).unwrap(),
        );
        assert_eq!(a.tensors.len(), b.tensors.len());
        for (name, ta) in &a.tensors {
            let tb = &b.tensors[name];
            assert_eq!(ta.ggml_type, tb.ggml_type, "{name}");
            assert_eq!(a.tensor_bytes(ta), b.tensor_bytes(tb), "{name}");
        }
        assert_eq!(
            b.metadata.u64("general.file_type").unwrap(),
            QuantMix::Q4KM.file_type() as u64
        );
        assert_eq!(
            a.metadata.str_array("tokenizer.ggml.tokens").unwrap(),
            b.metadata.str_array("tokenizer.ggml.tokens").unwrap()
        );
    }

    #[test]
    fn a_quantized_model_is_refused_and_nothing_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let (q, out) = (dir.path().join("q.gguf"), dir.path().join("out.gguf"));
        synthesize_gguf(
            &tiny(),
            &q,
            false,
            Some(QuantMix::Pure(DType::Q8_0)),
            &mut |_, _| {},
        )
        .unwrap();
        let e = quantize_gguf(&q, &out, QuantMix::Q4KM, false, &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("already quantized"), "{e}");
        assert!(!out.exists());
        // An existing output is kept unless forced.
        std::fs::write(&out, b"keep").unwrap();
        let f16 = dir.path().join("f.gguf");
        synthesize_gguf(&tiny(), &f16, false, None, &mut |_, _| {}).unwrap();
        let e = quantize_gguf(&f16, &out, QuantMix::Q4KM, false, &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("already exists"), "{e}");
        assert_eq!(std::fs::read(&out).unwrap(), b"keep");
    }
}
