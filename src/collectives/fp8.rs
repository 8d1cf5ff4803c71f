//! The two 8-bit float formats of NCCL 2.28 (`ncclFloat8e4m3`, `ncclFloat8e5m2`), their
//! conversions, and the arithmetic step NCCL reduces them with.
//!
//! NCCL computes an fp8 reduction step in half precision: both operands widen to `half`
//! (exactly), `__hadd` / `__hmul` / `__hmax` rounds the result to `half`, and the constructor
//! of the fp8 type rounds that to fp8, to nearest even, saturating to the largest finite value
//! (`__NV_SATFINITE`). Two fp8 values' exact sum and product fit in an `f32`, so the kernels
//! (and `step` here) compute in `f32`, round to `half` once and then to fp8: the same value as
//! NCCL's, bit for bit.
//!
//! The formats (OCP 8-bit floating point):
//! - E4M3: 4 exponent bits (bias 7), 3 mantissa bits, no infinities; `S.1111.111` is NaN, the
//!   largest finite value is 448 (`0x7e`), the smallest subnormal 2^-9.
//! - E5M2: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like: exponent 31 is infinity
//!   (mantissa 0) or NaN; the largest finite value is 57344 (`0x7b`), the smallest subnormal
//!   2^-16.

use super::types::{f16_to_f32, f32_to_f16};

/// One of the two fp8 formats.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Fp8 {
    E4M3,
    E5M2,
}

impl Fp8 {
    fn mantissa_bits(self) -> u32 {
        match self {
            Fp8::E4M3 => 3,
            Fp8::E5M2 => 2,
        }
    }

    fn bias(self) -> i32 {
        match self {
            Fp8::E4M3 => 7,
            Fp8::E5M2 => 15,
        }
    }

    /// The bits of the largest finite value (positive).
    fn max_finite(self) -> u8 {
        match self {
            Fp8::E4M3 => 0x7e,
            Fp8::E5M2 => 0x7b,
        }
    }

    /// The canonical NaN the GPU's conversions produce.
    const NAN: u8 = 0x7f;

    /// The value of `bits`; exact (every fp8 value is an `f32`).
    pub fn to_f32(self, bits: u8) -> f32 {
        let negative = bits & 0x80 != 0;
        let m = self.mantissa_bits();
        let exp = i32::from((bits & 0x7f) >> m);
        let man = u32::from(bits) & ((1 << m) - 1);
        let top = (1 << (7 - m)) - 1;
        let v = match (self, exp) {
            (Fp8::E4M3, 15) if man == 7 => f32::NAN,
            (Fp8::E5M2, e) if e == top => {
                if man == 0 {
                    f32::INFINITY
                } else {
                    f32::NAN
                }
            }
            // Subnormal: man · 2^(1 - bias - m).
            (_, 0) => man as f32 * 2f32.powi(1 - self.bias() - m as i32),
            (_, e) => (1.0 + man as f32 / (1 << m) as f32) * 2f32.powi(e - self.bias()),
        };
        if negative { -v } else { v }
    }

    /// `x` rounded to this format, to nearest even, saturating: values beyond the largest
    /// finite value, infinities included, become it (with their sign); NaN becomes NaN.
    pub fn from_f64_satfinite(self, x: f64) -> u8 {
        if x.is_nan() {
            return Self::NAN;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs();
        let max = self.to_f32(self.max_finite()) as f64;
        if a >= max {
            return sign | self.max_finite();
        }
        let m = self.mantissa_bits() as i32;
        // The spacing of representable values around `a`: 2^(e - m) for a normal exponent e,
        // the subnormals' below the smallest normal exponent.
        let min_exp = 1 - self.bias();
        let e = if a == 0.0 { min_exp } else { (a.log2().floor() as i32).max(min_exp) };
        // log2 can be off by one next to a power of two; the scaled value must lie in
        // [2^m, 2^(m+1)) for normals.
        let e = if a >= 2f64.powi(e + 1) {
            e + 1
        } else if e > min_exp && a < 2f64.powi(e) {
            e - 1
        } else {
            e
        };
        let quantum = 2f64.powi(e - m);
        // Exact: a power-of-two scaling of a finite f64 well inside its range.
        let scaled = a / quantum;
        let mut k = scaled.floor();
        let rest = scaled - k;
        if rest > 0.5 || (rest == 0.5 && k % 2.0 == 1.0) {
            k += 1.0;
        }
        let r = k * quantum;
        if r >= max {
            return sign | self.max_finite();
        }
        sign | self.encode_exact(r)
    }

    /// The bits of a non-negative value this format holds exactly (below its largest finite).
    fn encode_exact(self, r: f64) -> u8 {
        let m = self.mantissa_bits() as i32;
        let min_exp = 1 - self.bias();
        if r < 2f64.powi(min_exp) {
            // Subnormal (or zero): r = man · 2^(min_exp - m).
            return (r / 2f64.powi(min_exp - m)) as u8;
        }
        let mut e = r.log2().floor() as i32;
        if r < 2f64.powi(e) {
            e -= 1;
        } else if r >= 2f64.powi(e + 1) {
            e += 1;
        }
        let man = (r / 2f64.powi(e - m)) as i32 - (1 << m);
        (((e + self.bias()) << m) | man) as u8
    }

    /// NCCL's reduction step on an exact result: `exact` rounded to `half`, then to this format
    /// (saturating). An `f32` holds every exact sum and product of two fp8 values.
    pub fn step(self, exact: f32) -> u8 {
        self.from_f64_satfinite(f64::from(f16_to_f32(f32_to_f16(exact))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_of_both_formats() {
        let e4 = Fp8::E4M3;
        assert_eq!(e4.to_f32(0x00), 0.0);
        assert_eq!(e4.to_f32(0x38), 1.0);
        assert_eq!(e4.to_f32(0x7e), 448.0);
        assert_eq!(e4.to_f32(0xfe), -448.0);
        assert_eq!(e4.to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4.to_f32(0x08), 2f32.powi(-6), "the smallest normal");
        assert!(e4.to_f32(0x7f).is_nan() && e4.to_f32(0xff).is_nan());
        assert_eq!(e4.to_f32(0x78), 256.0, "exponent 15 is finite in E4M3");
        let e5 = Fp8::E5M2;
        assert_eq!(e5.to_f32(0x3c), 1.0);
        assert_eq!(e5.to_f32(0x7b), 57344.0);
        assert_eq!(e5.to_f32(0x7c), f32::INFINITY);
        assert_eq!(e5.to_f32(0xfc), f32::NEG_INFINITY);
        assert!(e5.to_f32(0x7d).is_nan());
        assert_eq!(e5.to_f32(0x01), 2f32.powi(-16));
        assert_eq!(e5.to_f32(0x80), 0.0);
        assert!(e5.to_f32(0x80).is_sign_negative());
    }

    #[test]
    fn every_finite_value_converts_back_to_its_bits() {
        for f in [Fp8::E4M3, Fp8::E5M2] {
            for b in 0..=255u8 {
                let v = f.to_f32(b);
                if v.is_finite() {
                    assert_eq!(f.from_f64_satfinite(v.into()), b, "{f:?} {b:#04x} = {v}");
                }
            }
        }
    }

    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        let e4 = Fp8::E4M3;
        // Between 1 (0x38) and 1.125 (0x39): the midpoint goes to the even mantissa.
        assert_eq!(e4.from_f64_satfinite(1.0625), 0x38);
        assert_eq!(e4.from_f64_satfinite(1.0626), 0x39);
        assert_eq!(e4.from_f64_satfinite(1.1875), 0x3a, "1.1875 lies between 0x39 and 0x3a: to the even");
        // Beyond the largest finite value, and infinity: saturate.
        assert_eq!(e4.from_f64_satfinite(1e9), 0x7e);
        assert_eq!(e4.from_f64_satfinite(f64::NEG_INFINITY), 0xfe);
        assert_eq!(e4.from_f64_satfinite(f64::NAN), 0x7f);
        // Subnormals: half the smallest rounds to zero (even), a bit more to it.
        assert_eq!(e4.from_f64_satfinite(2f64.powi(-10)), 0x00);
        assert_eq!(e4.from_f64_satfinite(1.5 * 2f64.powi(-10)), 0x01);
        assert_eq!(e4.from_f64_satfinite(3.0 * 2f64.powi(-10)), 0x02, "1.5 quanta: to the even 2");
        // Rounding up out of the subnormals into the smallest normal.
        assert_eq!(e4.from_f64_satfinite(7.5 * 2f64.powi(-9)), 0x08);
        let e5 = Fp8::E5M2;
        assert_eq!(e5.from_f64_satfinite(1.125), 0x3c);
        assert_eq!(e5.from_f64_satfinite(1.375), 0x3e, "midpoint of 1.25 and 1.5: to the even 1.5");
        assert_eq!(e5.from_f64_satfinite(f64::INFINITY), 0x7b);
        assert_eq!(e5.from_f64_satfinite(-60000.0), 0xfb);
    }

    #[test]
    fn the_step_goes_through_half() {
        let e4 = Fp8::E4M3;
        // 448 + 448 = 896: a half, beyond E4M3: saturates.
        assert_eq!(e4.step(896.0), 0x7e);
        let e5 = Fp8::E5M2;
        // 57344 · 2 overflows half to infinity, which saturates.
        assert_eq!(e5.step(114_688.0), 0x7b);
        // A product below half's subnormals flushes to zero in half before fp8 sees it:
        // 2^-16 · 2^-16 = 2^-32.
        assert_eq!(e5.step(2f32.powi(-32)), 0x00);
        assert_eq!(e4.step(1.0 + 2f32.powi(-9)), 0x38);
    }
}
