//! A counter-based random number generator: every draw is a hash of its key
//! (the seed and what the value is: a parameter's element, a data token), so
//! a value never depends on how the batch or the parameters are split across
//! ranks or in what order they run. Dropout's draw, keyed the same way
//! (seed, step, node, layer, sample, position), is codegen's `sample_draw`,
//! which the CPU reference and every fused kernel share.
//!
//! SplitMix64's finaliser is the mixing function (the same construction as
//! Philox/Threefry in spirit: a stateless bijective mix of a counter); it needs
//! no dependency and passes BigCrush as a stream generator.

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A 64-bit hash of a key of words.
pub fn hash(words: &[u64]) -> u64 {
    words
        .iter()
        .fold(0x243F_6A88_85A3_08D3, |acc, &w| mix(acc ^ mix(w)))
}

/// A uniform draw in `[0, 1)` with 24 bits, exactly representable in f32.
pub fn uniform(words: &[u64]) -> f32 {
    (hash(words) >> 40) as f32 / (1u64 << 24) as f32
}

/// A standard normal draw (Box–Muller over two hashed uniforms, in f64).
pub fn normal(words: &[u64]) -> f64 {
    let h = hash(words);
    let u1 = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let u2 = (mix(h) >> 11) as f64 / (1u64 << 53) as f64;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_draws_have_unit_variance() {
        let n = 20000;
        let xs: Vec<f64> = (0..n).map(|i| normal(&[7, i])).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
        let u: f32 = (0..n).map(|i| uniform(&[1, i])).sum::<f32>() / n as f32;
        assert!((u - 0.5).abs() < 0.01);
    }
}
