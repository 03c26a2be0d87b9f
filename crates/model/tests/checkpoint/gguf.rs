//! GGUF export → import round trips: f32 exact, Q8_0 within its quantisation error, llama's q/k row layout (part of the `checkpoint` test binary).

use super::*;

/// The `tiny` preset's shapes and tokenizer with `arch`'s tensors (common's perturbed random
/// weights), written as a complete model directory.
fn preset_dir(arch: Architecture, seed: u64) -> (tempfile::TempDir, ModelWeights) {
    let mut config = presets::preset_config(presets::Preset::Tiny);
    config.architecture = arch;
    let snap = snapshot(config, seed, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    presets::write_model_dir(&snap, dir.path()).unwrap();
    (dir, snap)
}

/// Exports `dir` to GGUF with `options` and imports it into a fresh directory.
fn gguf_round_trip(dir: &Path, options: &ExportOptions) -> (tempfile::TempDir, ModelWeights) {
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("model.gguf");
    export_gguf(dir, &file, options).unwrap();
    let imported = out.path().join("hf");
    import_gguf(&file, &imported, &ImportOptions::default()).unwrap();
    let loaded = load_checkpoint(&imported, &LoadOptions::default()).unwrap();
    (out, loaded)
}

fn logits(w: &ModelWeights) -> Tensor {
    let model = TrainableModel::from_snapshot(w, DType::F32).unwrap();
    reference_logits(&model, &[5, 17, 40, 2, 99, 63, 8, 101, 33])
}

#[test]
fn gguf_import_of_an_f32_export_gives_the_same_weights_config_and_logits() {
    for (i, arch) in ALL_ARCHS.into_iter().enumerate() {
        let (dir, snap) = preset_dir(arch, 11 + i as u64);
        let options = ExportOptions {
            matrix_type: GgmlDType::F32,
            pre_tokenizer: "qwen2".into(),
            version: 2 + (i as u32 % 2),
        };
        let (_out, loaded) = gguf_round_trip(dir.path(), &options);
        // Bit-exact tensors (llama's q/k rows permuted on export and restored on import) and
        // the same config (eps and theta survive the f32 metadata).
        assert_same(&snap, &loaded);
        let err = common::rel_err(&logits(&loaded), &logits(&snap));
        assert!(err <= 1e-5, "{arch:?}: logits differ by {err:e}");
    }
}

/// llama.cpp's layout of a llama q/k projection: HF row `h·d + j·d/2 + i` is GGUF row
/// `h·d + 2i + j`; qwen2 rows are stored as they are.
#[test]
fn gguf_llama_q_and_k_rows_are_interleaved_per_head_qwen2_rows_are_not() {
    for arch in [Architecture::Llama, Architecture::Qwen2] {
        let (dir, snap) = preset_dir(arch, 3);
        let file = dir.path().join("model.gguf");
        export_gguf(dir.path(), &file, &ExportOptions::default()).unwrap();
        let mut g = GgufFile::open(&file).unwrap();
        let config = snap.config();
        let d = config.head_dim;
        for (proj, short, heads) in [
            ("q_proj", "attn_q", config.num_heads),
            ("k_proj", "attn_k", config.num_kv_heads),
        ] {
            let hf: Vec<Vec<f32>> = snap
                .get(&format!("model.layers.1.self_attn.{proj}.weight"))
                .unwrap()
                .to_vec2()
                .unwrap();
            let stored: Vec<Vec<f32>> = g
                .tensor_f32(&format!("blk.1.{short}.weight"))
                .unwrap()
                .to_vec2()
                .unwrap();
            for h in 0..heads {
                for i in 0..d / 2 {
                    for j in 0..2 {
                        let hf_row = h * d + j * d / 2 + i;
                        let gguf_row = if arch == Architecture::Llama {
                            h * d + 2 * i + j
                        } else {
                            hf_row
                        };
                        assert_eq!(stored[gguf_row], hf[hf_row], "{arch:?} {proj} head {h}");
                    }
                }
            }
        }
    }
}

/// Q8_0 stores each block of 32 weights as an f16 scale `amax/127` and 8-bit integers: the
/// importer must give exactly the dequantised values (checked bit for bit against candle's
/// own quantise→dequantise), and the logits stay within the quantisation error.
#[test]
fn gguf_import_of_a_q8_0_export_is_the_dequantised_model() {
    let (dir, snap) = preset_dir(Architecture::Llama, 21);
    let options = ExportOptions {
        matrix_type: GgmlDType::Q8_0,
        pre_tokenizer: "qwen2".into(),
        version: 3,
    };
    let (_out, loaded) = gguf_round_trip(dir.path(), &options);
    for (name, t) in snap.iter() {
        let expected = if t.rank() == 2 {
            QTensor::quantize(t, GgmlDType::Q8_0)
                .unwrap()
                .dequantize(&candle_core::Device::Cpu)
                .unwrap()
        } else {
            t.clone()
        };
        assert_eq!(bits(loaded.get(name).unwrap()), bits(&expected), "{name}");
    }
    // Each weight moves by at most amax/254 of its 32-weight block (≈0.8% of the weights'
    // spread); through two layers, attention's softmax and the tied head, the logits of this
    // model (weights 5× init, so far from uniform) move by 2.2% of their largest magnitude.
    // Bound: 5%, and more than nothing.
    let err = common::rel_err(&logits(&loaded), &logits(&snap));
    assert!(err <= 5e-2, "Q8_0 logits differ by {err:e}");
    assert!(err > 0.0, "Q8_0 cannot be lossless on random weights");
}
