//! f32 ↔ bf16 / f16 bit conversions on the host (round to nearest even), for
//! uploading and reading back tensors stored in 16-bit types on the device.

/// f32 to bf16 bits, rounding to nearest even; NaN stays NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// f32 to IEEE half bits, rounding to nearest even, with subnormals and overflow to infinity.
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x007f_ffff;
    if exp == 0xff {
        let nan = if man != 0 { 0x0200 } else { 0 };
        return sign | 0x7c00 | nan;
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        // Subnormal: shift the mantissa (with its hidden bit) into place.
        let m = man | 0x0080_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rest = m & ((1u32 << shift) - 1);
        let mut out = m >> shift;
        if rest > half || (rest == half && out & 1 == 1) {
            out += 1;
        }
        return sign | out as u16;
    }
    let mut out = ((e as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && out & 1 == 1) {
        // May carry into the exponent, up to infinity: both are right.
        out += 1;
    }
    sign | out as u16
}

pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x03ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value = m * 2^-24.
            let v = m as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trips_and_rounds_to_even() {
        for x in [
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            3.140625,
            2f32.powi(100),
            -(2f32.powi(-100)),
            f32::INFINITY,
        ] {
            assert_eq!(bf16_to_f32(f32_to_bf16(x)), x, "{x}");
        }
        // 1 + 2^-8 is halfway between two bf16 values: rounds to the even one (1.0).
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 1.0 / 256.0)), 1.0);
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 3.0 / 256.0)), 1.015625);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn f16_round_trips_rounds_and_saturates() {
        for x in [
            0.0f32,
            1.0,
            -2.5,
            65504.0,
            6.103_515_6e-5,
            5.960_464_5e-8,
            -0.333_251_95,
        ] {
            assert_eq!(f16_to_f32(f32_to_f16(x)), x, "{x}");
        }
        assert_eq!(f16_to_f32(f32_to_f16(1.0 + 1.0 / 2048.0)), 1.0);
        assert_eq!(f16_to_f32(f32_to_f16(70000.0)), f32::INFINITY);
        assert_eq!(f16_to_f32(f32_to_f16(1e-9)), 0.0);
        assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
        for i in 0..2000 {
            let x = (i as f32 - 1000.0) * 0.37;
            let y = f16_to_f32(f32_to_f16(x));
            assert!((x - y).abs() <= x.abs() * (1.0 / 2048.0) + 1e-7, "{x} {y}");
        }
    }
}
