//! Hardware as data: a cluster section may describe its device
//! (`accelerator(…)`) instead of naming one from the catalog, and the
//! catalog names today's devices (H200, GH200, B200, MI300X).

use std::process::{Command, Output};

fn dplc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dplc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("dplc runs")
}

fn estimate(cluster: &str) -> serde_json::Value {
    let out = dplc(&[
        "compile",
        "models/gpt2.dpl",
        "--model",
        "gpt2",
        "--cluster",
        cluster,
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{cluster}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    v["estimate"].clone()
}

/// The catalog's H100, written out as data, plans exactly as the catalog's.
#[test]
fn a_described_device_plans_as_the_catalog_device_it_describes() {
    let dir = std::env::temp_dir().join(format!("dplc-hw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("h100_as_data.dpl");
    std::fs::write(
        &file,
        r#"cluster h100_as_data {
    nodes = 1
    devices_per_node = 8
    device = accelerator(name = "my-H100", bf16 = 989.4 TFLOP/s, fp16 = 989.4 TFLOP/s,
        fp32 = 66.9 TFLOP/s, memory = 80 GiB, memory_bandwidth = 3350 GB/s,
        matmul_efficiency = 0.7160905599353143,
        flash2_efficiency = 0.287143723468769,
        flash2_backward_efficiency = 0.29017586416009705,
        fused_attention_efficiency = 0.6367495451788964,
        fused_attention_backward_efficiency = 0.5372953305033354,
        unaligned_matmul_efficiency = 0.12511995670597734,
        attention_dropout_forward_ps = 0.7064254195601852,
        attention_dropout_backward_ps = 0.3885339807581018, multiprocessors = 132)
    intra_node = nvswitch(bandwidth = 450 GB/s, latency = 2 us)
    inter_node = infiniband(bandwidth = 50 GB/s per device, latency = 5 us)
}
"#,
    )
    .unwrap();
    let ours = estimate(file.to_str().unwrap());
    let catalog = estimate("8xH100");
    let (a, b) = (
        ours["step_time_s"].as_f64().unwrap(),
        catalog["step_time_s"].as_f64().unwrap(),
    );
    assert!((a - b).abs() <= 1e-9 * b, "{a} vs {b}");
    assert_eq!(ours["peak_memory_bytes"], catalog["peak_memory_bytes"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A described device without the links its devices use is refused.
#[test]
fn a_described_device_needs_its_links() {
    let dir = std::env::temp_dir().join(format!("dplc-hw-links-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bare.dpl");
    std::fs::write(
        &file,
        "cluster bare {\n    devices_per_node = 8\n    device = accelerator(name = \"X\", bf16 = 100 TFLOP/s, memory = 16 GB, memory_bandwidth = 1 TB/s)\n}\n",
    )
    .unwrap();
    let out = dplc(&[
        "compile",
        "models/gpt2.dpl",
        "--model",
        "gpt2",
        "--cluster",
        file.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr).replace("\n  | ", " ");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("must give `intra_node`"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Today's devices by name: more memory, bandwidth and compute than H100
/// plan at least as fast.
#[test]
fn the_catalog_names_todays_devices() {
    let h100 = estimate("8xH100")["step_time_s"].as_f64().unwrap();
    for name in ["8xH200", "8xGH200", "8xB200", "8xMI300X"] {
        let t = estimate(name)["step_time_s"].as_f64().unwrap();
        assert!(t > 0.0 && t <= h100 * 1.0001, "{name}: {t} vs H100 {h100}");
    }
}

/// A described device's FP8 rate is what `fp8=on` plans with; without one,
/// `fp8=on` is refused.
#[test]
fn a_described_device_runs_fp8_at_its_own_rate() {
    let dir = std::env::temp_dir().join(format!("dplc-hw-fp8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let section = |fp8: &str| {
        format!(
            "cluster x {{\n    devices_per_node = 8\n    device = accelerator(name = \"X\", \
             bf16 = 1000 TFLOP/s,{fp8} memory = 80 GB, memory_bandwidth = 3 TB/s)\n    \
             intra_node = nvswitch(bandwidth = 450 GB/s, latency = 2 us)\n}}\n"
        )
    };
    let compile = |name: &str, fp8: &str| {
        let file = dir.join(name);
        std::fs::write(&file, section(fp8)).unwrap();
        dplc(&[
            "compile",
            "models/llama3.dpl",
            "--model",
            "llama3_8b",
            "--seq",
            "4096",
            "--cluster",
            file.to_str().unwrap(),
            "--strategy",
            "tp=2,dp=4,fp8=on",
            "--json",
        ])
    };
    let step = |out: &Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["estimate"]["step_time_s"].as_f64().unwrap()
    };
    let slow = step(&compile("fp8_1000.dpl", " fp8 = 1000 TFLOP/s,"));
    let fast = step(&compile("fp8_2000.dpl", " fp8 = 2000 TFLOP/s,"));
    assert!(fast < 0.8 * slow, "{fast} vs {slow}");
    let none = compile("no_fp8.dpl", "");
    assert!(!none.status.success());
    assert!(String::from_utf8_lossy(&none.stdout).contains("FP8 tensor cores"));
    let _ = std::fs::remove_dir_all(&dir);
}
