//! Inputs of any declared dtype and shape: an image classifier (the zoo's
//! vit_tiny: float images, integer labels) trains under every split on both
//! computes as the serial run does; arrays in `.npy` and safetensors files
//! feed the inputs they name; data that does not fit its input is refused by
//! name.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn dplc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dplc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("dplc runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The losses of `dplc run models/vit.dpl --model vit_tiny … --json`.
fn losses(extra: &[&str]) -> Vec<f64> {
    let mut args = vec![
        "run",
        "models/vit.dpl",
        "--model",
        "vit_tiny",
        "--steps",
        "3",
        "--json",
    ];
    args.extend(extra);
    let out = dplc(&args);
    assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON lines"))
        .collect();
    let summary = lines.last().expect("a summary");
    // An image model counts samples, not tokens.
    assert!(summary["samples_per_s"].as_f64().is_some(), "{summary}");
    assert!(summary.get("tokens_per_s").is_none(), "{summary}");
    lines.iter().filter_map(|v| v["loss"].as_f64()).collect()
}

fn assert_same(name: &str, a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{name}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{name}: {a:?} vs {b:?}");
    }
}

#[test]
fn an_image_classifier_trains_under_every_split_on_both_computes() {
    let serial = losses(&["--cluster", "1xcpu"]);
    // Ten classes: the loss starts near ln 10.
    assert!((serial[0] - 10f64.ln()).abs() < 0.3, "{serial:?}");
    for strategy in ["dp=2", "pp=2", "tp=2", "dp=2,tp=2", "dp=2,pp=2,zero=1"] {
        for compute in ["reference", "fused"] {
            let run = losses(&[
                "--cluster",
                "4xcpu",
                "--strategy",
                strategy,
                "--compute",
                compute,
            ]);
            assert_same(&format!("{strategy} {compute}"), &serial, &run);
        }
    }
}

/// `dplc verify` checks the planner's split of the classifier, parameters
/// included, on the fused compute.
#[test]
fn verify_checks_an_image_classifier() {
    let dir = scratch("verify");
    let plan = dir.join("vit.ron");
    let out = dplc(&[
        "compile",
        "models/vit.dpl",
        "--model",
        "vit_tiny",
        "--cluster",
        "4xcpu",
        "--strategy",
        "dp=2,tp=2",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    for compute in ["reference", "fused"] {
        let out = dplc(&[
            "verify",
            plan.to_str().unwrap(),
            "--json",
            "--compute",
            compute,
            "--steps",
            "3",
        ]);
        assert!(out.status.success(), "{compute}: {}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["pass"], true, "{compute}: {v}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

fn scratch(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dplc-inputs-{what}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A version-1 `.npy` file of `shape` holding `data` (`descr` `<f4` or `<i8`).
fn write_npy(path: &Path, descr: &str, shape: &[usize], data: &[u8]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

/// A safetensors file of named tensors (`F32` or `I64`, shape, bytes).
fn write_safetensors(path: &Path, tensors: &[(&str, &str, &[usize], &[u8])]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, dtype, shape, data) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [offset, offset + data.len()],
            }),
        );
        offset += data.len();
    }
    let header = serde_json::Value::Object(header).to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    for (_, _, _, data) in tensors {
        bytes.extend(*data);
    }
    std::fs::write(path, bytes).unwrap();
}

/// Sixteen images of 3×16×16 and their labels, as little-endian bytes.
fn dataset() -> (Vec<u8>, Vec<u8>) {
    let images: Vec<u8> = (0..16 * 3 * 16 * 16)
        .flat_map(|i| (((i * 7919) % 255) as f32 / 127.0 - 1.0).to_le_bytes())
        .collect();
    let labels: Vec<u8> = (0..16i64).flat_map(|i| (i % 10).to_le_bytes()).collect();
    (images, labels)
}

#[test]
fn arrays_feed_the_inputs_they_name() {
    let dir = scratch("arrays");
    let (images, labels) = dataset();
    let (img, lab, st) = (
        dir.join("images.npy"),
        dir.join("labels.npy"),
        dir.join("data.safetensors"),
    );
    write_npy(&img, "<f4", &[16, 3, 16, 16], &images);
    write_npy(&lab, "<i8", &[16], &labels);
    write_safetensors(
        &st,
        &[
            ("images", "F32", &[16, 3, 16, 16], &images),
            ("labels", "I64", &[16], &labels),
        ],
    );
    let img_arg = format!("images={}", img.display());
    let lab_arg = format!("labels={}", lab.display());
    let npy = losses(&["--cluster", "1xcpu", "--data", &img_arg, "--data", &lab_arg]);
    let tensors = losses(&["--cluster", "1xcpu", "--data", st.to_str().unwrap()]);
    assert_same("npy vs safetensors", &npy, &tensors);
    let split = losses(&[
        "--cluster",
        "2xcpu",
        "--strategy",
        "dp=2",
        "--data",
        st.to_str().unwrap(),
    ]);
    assert_same("the data split over dp", &npy, &split);
    let synthetic = losses(&["--cluster", "1xcpu"]);
    assert!((npy[0] - synthetic[0]).abs() > 1e-4, "the arrays were read");

    // Data that does not fit its input is refused, naming it.
    let bad_labels: Vec<u8> = (0..16i64).flat_map(|i| (i + 3).to_le_bytes()).collect();
    let bad = dir.join("bad.npy");
    write_npy(&bad, "<i8", &[16], &bad_labels);
    let wide = dir.join("wide.npy");
    write_npy(&wide, "<f4", &[4, 3, 8, 8], &images[..4 * 3 * 8 * 8 * 4]);
    // Data that would feed nothing is refused too, not silently replaced
    // by synthetic samples: a misspelt input, a safetensors file of other
    // tensors, an input given twice; and a header whose shape's product
    // wraps around to the element count the file holds.
    let other = dir.join("other.safetensors");
    write_safetensors(&other, &[("pixels", "F32", &[16, 3, 16, 16], &images)]);
    let wrap = dir.join("wrap.npy");
    let huge = (1usize << 62) + 1;
    write_npy(&wrap, "<i8", &[huge, 4], &labels[..4 * 8]);
    let a = |s: String| vec![s];
    for (args, says) in [
        (
            a(format!("labels={}", bad.display())),
            "input `labels`: id 10 is outside [0, 10)",
        ),
        (
            a(format!("images={}", wide.display())),
            "input `images`: the model takes samples of shape [3, 16, 16]",
        ),
        (
            a(format!("images={}", dir.join("missing.npy").display())),
            "cannot read",
        ),
        (
            a(format!("imagez={}", img.display())),
            "the data holds `imagez`, which is no input",
        ),
        (
            a(other.display().to_string()),
            "the data holds `pixels`, which is no input",
        ),
        (
            vec![img_arg.clone(), format!("images={}", wide.display())],
            "input `images` is already fed by an earlier --data",
        ),
        (
            a(format!("labels={}", wrap.display())),
            "has more elements than memory can address",
        ),
    ] {
        let mut argv = vec![
            "run",
            "models/vit.dpl",
            "--model",
            "vit_tiny",
            "--cluster",
            "1xcpu",
            "--steps",
            "1",
        ];
        for arg in &args {
            argv.extend(["--data", arg]);
        }
        let out = dplc(&argv);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        // The message as one line, however the report wrapped it.
        let said = stderr(&out).replace("\n  | ", " ");
        assert!(said.contains(says), "{args:?}: {said}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// An integer input nothing indexes with has no range to draw from: the
/// run asks for its data instead of inventing it.
#[test]
fn an_integer_input_without_a_range_asks_for_data() {
    let dir = scratch("range");
    let model = dir.join("m.dpl");
    std::fs::write(
        &model,
        "model m(d = 4, layers = 2) {\n    input x: f32[batch, d]\n    input counts: i32[batch, d]\n    \
         h = x\n    repeat layers {\n        h = linear(h, d, d)\n    }\n    \
         return mean(mean(h * cast(counts, f32), -1), -1)\n}\n",
    )
    .unwrap();
    let out = dplc(&[
        "run",
        model.to_str().unwrap(),
        "--cluster",
        "1xcpu",
        "--steps",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("integer input `counts`: nothing in the model indexes with it"),
        "{}",
        stderr(&out)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The zoo's T5 (t5_tiny: encoder over the token stream, decoder over
/// `targets [batch, tgt]` shifted right) trains serially on both computes
/// with the loss falling: four target rows from an array, each a run of
/// consecutive ids, so the next id follows from the shifted decoder input.
#[test]
fn t5_tiny_trains_on_targets_from_an_array() {
    let dir = scratch("t5");
    let path = dir.join("targets.npy");
    let ids: Vec<u8> = (0..4i64)
        .flat_map(|s| (0..16i64).map(move |j| (s * 9 + j) % 64))
        .flat_map(|x| x.to_le_bytes())
        .collect();
    write_npy(&path, "<i8", &[4, 16], &ids);
    let data = format!("targets={}", path.display());
    let mut runs = Vec::new();
    for compute in ["reference", "fused"] {
        let out = dplc(&[
            "run",
            "models/t5.dpl",
            "--model",
            "t5_tiny",
            "--cluster",
            "1xcpu",
            "--seq",
            "16",
            "--steps",
            "30",
            "--json",
            "--compute",
            compute,
            "--data",
            &data,
        ]);
        assert!(out.status.success(), "{compute}: {}", stderr(&out));
        let losses: Vec<f64> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["loss"].as_f64())
            .collect();
        assert_eq!(losses.len(), 30, "{compute}: {losses:?}");
        // 64 ids: the loss starts near ln 64 and falls at every step (the
        // head reads the decoder's output scaled by 1/sqrt(d), so slowly:
        // 4.16 to 3.72 in 30 steps).
        assert!(
            (losses[0] - 64f64.ln()).abs() < 0.3,
            "{compute}: {losses:?}"
        );
        assert!(
            losses.windows(2).all(|w| w[1] < w[0]),
            "{compute}: {losses:?}"
        );
        assert!(losses[29] < losses[0] - 0.3, "{compute}: {losses:?}");
        runs.push(losses);
    }
    assert_same("t5_tiny fused", &runs[0][..3], &runs[1][..3]);
    std::fs::remove_dir_all(&dir).ok();
}
