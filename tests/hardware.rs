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
        matmul_efficiency = 0.8005862138669901, multiprocessors = 132)
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
