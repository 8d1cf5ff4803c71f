//! NCCL-style datatypes and reduction operators, and a host reference reduction.
//!
//! `DataType` and `RedOp` carry the `ncclDataType_t` / `ncclRedOp_t` numbers (NCCL 2.28) so the
//! C API can take NCCL values unchanged, plus the names and kernel tags the rest of the crate uses.
//!
//! `reduce_reference` is what tests check GPU reductions against, bit for bit. Its semantics are
//! therefore fixed, not "whatever is convenient on the host": the reduction kernels fold ranks in
//! the same order with the same per-step arithmetic, so any change here must be made in the
//! kernels too (and the other way round):
//!
//! - ranks are folded in order: `acc = x[0]; acc = op(acc, x[i])` for `i = 1..n`;
//! - integers wrap on overflow (sum and prod) and compare in their own signedness;
//! - `Float32` / `Float64` use the native operation of that type (IEEE, round to nearest even, no
//!   flush to zero); max / min keep the accumulator unless the new value is strictly greater /
//!   smaller, so on equal values (`0.0` vs `-0.0`) and on NaN the earlier rank wins;
//! - `Float16` / `Bfloat16` widen both operands to `f32`, apply the `f32` operation and round the
//!   result back to the 16-bit type at every step;
//! - `Float8E4M3` / `Float8E5M2` step as NCCL does (`fp8`): widen to `f32`, apply the `f32`
//!   operation, round to `half`, then to the fp8 type, saturating to its largest finite value;
//! - `Avg` is the `Sum` above, then one division by the number of ranks — except for the fp8
//!   types, which NCCL averages as a pre-multiplied sum with 1/n rounded to the type
//!   (`fp8_avg_scalar`), and so do we.
//!
//! NaN payloads are not part of the contract: GPUs return a canonical NaN where the host keeps
//! the payload, so tests compare NaN results as "is NaN", never by bits.

use super::fp8::Fp8;
use crate::error::{Error, Result};

/// An element type, with the values of NCCL 2.28's `ncclDataType_t`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    Int8,
    Uint8,
    Int32,
    Uint32,
    Int64,
    Uint64,
    Float16,
    Float32,
    Float64,
    Bfloat16,
    /// 8-bit float, 4 exponent and 3 mantissa bits (`fp8::Fp8::E4M3`).
    Float8E4M3,
    /// 8-bit float, 5 exponent and 2 mantissa bits (`fp8::Fp8::E5M2`).
    Float8E5M2,
}

impl DataType {
    /// Every type, in `ncclDataType_t` order.
    pub const ALL: [DataType; 12] = [
        DataType::Int8,
        DataType::Uint8,
        DataType::Int32,
        DataType::Uint32,
        DataType::Int64,
        DataType::Uint64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float8E4M3,
        DataType::Float8E5M2,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 | DataType::Float8E4M3 | DataType::Float8E5M2 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    /// The name NCCL's own tools print (`half`, `float`, ... rather than `float16`, `float32`).
    pub fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "int8",
            DataType::Uint8 => "uint8",
            DataType::Int32 => "int32",
            DataType::Uint32 => "uint32",
            DataType::Int64 => "int64",
            DataType::Uint64 => "uint64",
            DataType::Float16 => "half",
            DataType::Float32 => "float",
            DataType::Float64 => "double",
            DataType::Bfloat16 => "bfloat16",
            DataType::Float8E4M3 => "f8e4m3",
            DataType::Float8E5M2 => "f8e5m2",
        }
    }

    /// The short tag that names the type in kernel symbols.
    pub fn kernel_tag(self) -> &'static str {
        match self {
            DataType::Int8 => "i8",
            DataType::Uint8 => "u8",
            DataType::Int32 => "i32",
            DataType::Uint32 => "u32",
            DataType::Int64 => "i64",
            DataType::Uint64 => "u64",
            DataType::Float16 => "f16",
            DataType::Float32 => "f32",
            DataType::Float64 => "f64",
            DataType::Bfloat16 => "bf16",
            DataType::Float8E4M3 => "e4m3",
            DataType::Float8E5M2 => "e5m2",
        }
    }

    /// The type for an `ncclDataType_t` value.
    pub fn from_nccl(v: i32) -> Result<DataType> {
        match v {
            0 => Ok(DataType::Int8),
            1 => Ok(DataType::Uint8),
            2 => Ok(DataType::Int32),
            3 => Ok(DataType::Uint32),
            4 => Ok(DataType::Int64),
            5 => Ok(DataType::Uint64),
            6 => Ok(DataType::Float16),
            7 => Ok(DataType::Float32),
            8 => Ok(DataType::Float64),
            9 => Ok(DataType::Bfloat16),
            10 => Ok(DataType::Float8E4M3),
            11 => Ok(DataType::Float8E5M2),
            _ => Err(Error::invalid_param(format!("unknown ncclDataType_t value {v}"))),
        }
    }

    /// The `ncclDataType_t` value.
    pub fn nccl(self) -> i32 {
        match self {
            DataType::Int8 => 0,
            DataType::Uint8 => 1,
            DataType::Int32 => 2,
            DataType::Uint32 => 3,
            DataType::Int64 => 4,
            DataType::Uint64 => 5,
            DataType::Float16 => 6,
            DataType::Float32 => 7,
            DataType::Float64 => 8,
            DataType::Bfloat16 => 9,
            DataType::Float8E4M3 => 10,
            DataType::Float8E5M2 => 11,
        }
    }

    /// The type for a name: `name()` or one of NCCL's aliases (`char`, `int`, `float16`,
    /// `float32`, `float64`, `bf16`).
    pub fn parse(s: &str) -> Option<DataType> {
        match s {
            "char" => Some(DataType::Int8),
            "int" => Some(DataType::Int32),
            "float16" => Some(DataType::Float16),
            "float32" => Some(DataType::Float32),
            "float64" => Some(DataType::Float64),
            "bf16" => Some(DataType::Bfloat16),
            "fp8_e4m3" | "e4m3" => Some(DataType::Float8E4M3),
            "fp8_e5m2" | "e5m2" => Some(DataType::Float8E5M2),
            _ => DataType::ALL.into_iter().find(|t| t.name() == s),
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DataType::Float16 | DataType::Float32 | DataType::Float64 | DataType::Bfloat16) || self.fp8().is_some()
    }

    /// The fp8 format of an fp8 type.
    pub fn fp8(self) -> Option<Fp8> {
        match self {
            DataType::Float8E4M3 => Some(Fp8::E4M3),
            DataType::Float8E5M2 => Some(Fp8::E5M2),
            _ => None,
        }
    }

    /// Floats narrower than `f32` (16 and 8 bits): the kernels widen them to `f32` for every
    /// step and round back.
    pub fn is_narrow_float(self) -> bool {
        self.is_float() && self.size() < 4
    }

    /// Append `v` as one little-endian element of this type: test and benchmark data. Small
    /// integers (|v| up to 8, e5m2's limit) are exact in every type; integer types keep `v`'s
    /// low bits (negative values wrap in the unsigned ones, as `reduce_reference` expects),
    /// floats round to nearest (fp8 saturating).
    pub fn push_integer(self, v: i64, out: &mut Vec<u8>) {
        match self {
            DataType::Int8 | DataType::Uint8 => out.push(v as u8),
            DataType::Int32 | DataType::Uint32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
            DataType::Int64 | DataType::Uint64 => out.extend_from_slice(&v.to_le_bytes()),
            DataType::Float16 => out.extend_from_slice(&f32_to_f16(v as f32).to_le_bytes()),
            DataType::Bfloat16 => out.extend_from_slice(&f32_to_bf16(v as f32).to_le_bytes()),
            DataType::Float32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DataType::Float64 => out.extend_from_slice(&(v as f64).to_le_bytes()),
            DataType::Float8E4M3 => out.push(Fp8::E4M3.from_f64_satfinite(v as f64)),
            DataType::Float8E5M2 => out.push(Fp8::E5M2.from_f64_satfinite(v as f64)),
        }
    }
}

/// A reduction operator, with the values of NCCL's `ncclRedOp_t` (built-in operators only).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum RedOp {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

impl RedOp {
    /// Every operator, in `ncclRedOp_t` order.
    pub const ALL: [RedOp; 5] = [RedOp::Sum, RedOp::Prod, RedOp::Max, RedOp::Min, RedOp::Avg];

    pub fn name(self) -> &'static str {
        match self {
            RedOp::Sum => "sum",
            RedOp::Prod => "prod",
            RedOp::Max => "max",
            RedOp::Min => "min",
            RedOp::Avg => "avg",
        }
    }

    /// The tag that names the operator in kernel symbols (the same as `name()`).
    pub fn kernel_tag(self) -> &'static str {
        self.name()
    }

    /// The operator for an `ncclRedOp_t` value.
    pub fn from_nccl(v: i32) -> Result<RedOp> {
        match v {
            0 => Ok(RedOp::Sum),
            1 => Ok(RedOp::Prod),
            2 => Ok(RedOp::Max),
            3 => Ok(RedOp::Min),
            4 => Ok(RedOp::Avg),
            _ => Err(Error::invalid_param(format!("unknown or unsupported ncclRedOp_t value {v}"))),
        }
    }

    /// The `ncclRedOp_t` value.
    pub fn nccl(self) -> i32 {
        match self {
            RedOp::Sum => 0,
            RedOp::Prod => 1,
            RedOp::Max => 2,
            RedOp::Min => 3,
            RedOp::Avg => 4,
        }
    }

    /// The operator for a name as `name()` returns it.
    pub fn parse(s: &str) -> Option<RedOp> {
        RedOp::ALL.into_iter().find(|op| op.name() == s)
    }
}

/// The scalar of a pre-multiplied sum (NCCL's `ncclRedOpCreatePreMulSum`): every rank
/// multiplies its own input by its own scalar, then the products are summed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PreMulScalar {
    /// The value, as the little-endian bits of one element of the collective's type.
    Value(u64),
    /// The address of one element in this rank's GPU memory, read each time the kernel runs
    /// (NCCL's `ncclScalarDevice`: a captured collective then uses the value of the moment).
    Device(u64),
}

/// `input` (elements of `dtype`) multiplied by `scalar` (an element's bits) the way the
/// kernels do it before a pre-multiplied sum: integers wrap, floats multiply in their type,
/// 16-bit floats in `f32` rounded back, fp8 as NCCL does (`fp8::Fp8::step`). Reference for tests: `reduce_reference(dtype, Sum, ..)`
/// of every rank's scaled input is the collective's result.
pub fn premul_reference(dtype: DataType, scalar: u64, input: &[u8]) -> Vec<u8> {
    let w = dtype.size();
    assert!(input.len().is_multiple_of(w), "premul_reference: a partial element");
    let s = scalar.to_le_bytes();
    let mut out = Vec::with_capacity(input.len());
    macro_rules! each {
        ($t:ty, $mul:expr) => {{
            let m = <$t>::from_le_bytes(s[..w].try_into().expect("element width"));
            for e in input.chunks_exact(w) {
                let x = <$t>::from_le_bytes(e.try_into().expect("element width"));
                let f: fn($t, $t) -> $t = $mul;
                out.extend_from_slice(&f(x, m).to_le_bytes());
            }
        }};
    }
    match dtype {
        DataType::Int8 => each!(i8, |a, b| a.wrapping_mul(b)),
        DataType::Uint8 => each!(u8, |a, b| a.wrapping_mul(b)),
        DataType::Int32 => each!(i32, |a, b| a.wrapping_mul(b)),
        DataType::Uint32 => each!(u32, |a, b| a.wrapping_mul(b)),
        DataType::Int64 => each!(i64, |a, b| a.wrapping_mul(b)),
        DataType::Uint64 => each!(u64, |a, b| a.wrapping_mul(b)),
        DataType::Float32 => each!(f32, |a, b| a * b),
        DataType::Float64 => each!(f64, |a, b| a * b),
        DataType::Float16 => each!(u16, |a, b| f32_to_f16(f16_to_f32(a) * f16_to_f32(b))),
        DataType::Bfloat16 => each!(u16, |a, b| f32_to_bf16(bf16_to_f32(a) * bf16_to_f32(b))),
        DataType::Float8E4M3 => each!(u8, |a, b| Fp8::E4M3.step(Fp8::E4M3.to_f32(a) * Fp8::E4M3.to_f32(b))),
        DataType::Float8E5M2 => each!(u8, |a, b| Fp8::E5M2.step(Fp8::E5M2.to_f32(a) * Fp8::E5M2.to_f32(b))),
    }
    out
}

/// IEEE binary16 bits to `f32`. Exact: every half value, subnormals included, is an `f32`.
pub fn f16_to_f32(h: u16) -> f32 {
    let negative = h & 0x8000 != 0;
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    match exp {
        0 => {
            // Subnormal (or zero): man * 2^-24, exact in f32 since both factors are.
            let v = man as f32 * (1.0 / 16_777_216.0);
            if negative { -v } else { v }
        }
        // Inf or NaN; the payload moves to the top of the f32 mantissa, so a quiet NaN stays quiet.
        0x1f => f32::from_bits(sign | 0x7f80_0000 | (man << 13)),
        _ => f32::from_bits(sign | ((exp + 127 - 15) << 23) | (man << 13)),
    }
}

/// `f32` to IEEE binary16 bits, rounding to nearest even. Too large values become infinity,
/// results below the normal range are correctly rounded subnormals, and NaN stays NaN (quiet).
pub fn f32_to_f16(f: f32) -> u16 {
    let x = f.to_bits();
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = ((x >> 23) & 0xff) as i32;
    let man = x & 0x7f_ffff;

    if exp == 0xff {
        if man == 0 {
            return sign | 0x7c00;
        }
        // Forcing the quiet bit also keeps a NaN whose payload sits in the dropped low bits from
        // turning into infinity.
        return sign | 0x7e00 | (man >> 13) as u16;
    }

    let e = exp - 127;
    if e > 15 {
        return sign | 0x7c00;
    }
    if e >= -14 {
        // Normal range: drop 13 mantissa bits. A carry out of the mantissa correctly bumps the
        // exponent, up to 0x7c00 (infinity) for values that round past 65504.
        let mut bits = (((e + 15) as u32) << 10) | (man >> 13);
        let rem = man & 0x1fff;
        if rem > 0x1000 || (rem == 0x1000 && bits & 1 == 1) {
            bits += 1;
        }
        return sign | bits as u16;
    }
    if e < -25 {
        // Below 2^-25, half of the smallest subnormal: rounds to zero. f32 subnormals land here.
        return sign;
    }
    // Subnormal result, in units of 2^-24: the value is m * 2^(e - 23), so shift m right by
    // -(e + 1), which is 14..=24 here. Rounding up from 0x3ff gives 0x400, the smallest normal.
    let m = man | 0x80_0000;
    let shift = (-(e + 1)) as u32;
    let mut bits = m >> shift;
    let rem = m & ((1 << shift) - 1);
    let halfway = 1 << (shift - 1);
    if rem > halfway || (rem == halfway && bits & 1 == 1) {
        bits += 1;
    }
    sign | bits as u16
}

/// bfloat16 bits to `f32`: bfloat16 is the top half of an `f32`.
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// `f32` to bfloat16 bits, rounding to nearest even; NaN stays a quiet NaN.
pub fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    if f.is_nan() {
        // Truncating alone could leave a signaling NaN with only low payload bits as infinity.
        return (x >> 16) as u16 | 0x0040;
    }
    // Adding 0x7fff plus the kept lsb rounds to nearest even; cannot overflow u32 for non-NaN
    // inputs (the largest, -inf, is 0xff80_0000). Overflow of the exponent gives infinity.
    let lsb = (x >> 16) & 1;
    ((x + 0x7fff + lsb) >> 16) as u16
}

/// Element-wise reduction of `inputs` (one buffer per rank, in rank order) with the exact
/// semantics the GPU kernels use (see the module comment). Buffers hold little-endian elements
/// of `dtype`; the result has the same length as one input.
///
/// `Avg` divides the sum by `inputs.len()`: integers with truncating division of the (wrapped)
/// sum, `f32` / `f64` natively, `f16` / `bf16` in `f32` and rounded back; the fp8 types sum
/// their inputs pre-multiplied by 1/n instead (`fp8_avg_scalar`).
///
/// # Panics
///
/// If `inputs` is empty, the inputs differ in length, or their length is not a multiple of
/// `dtype.size()`: these are bugs in the calling test, not conditions to report.
pub fn reduce_reference(dtype: DataType, op: RedOp, inputs: &[&[u8]]) -> Vec<u8> {
    assert!(!inputs.is_empty(), "reduce_reference: no inputs");
    let len = inputs[0].len();
    for (rank, input) in inputs.iter().enumerate() {
        assert!(input.len() == len, "reduce_reference: input {rank} is {} bytes, input 0 is {len}", input.len());
    }
    assert!(
        len.is_multiple_of(dtype.size()),
        "reduce_reference: {len} bytes is not a whole number of {} elements ({} bytes each)",
        dtype.name(),
        dtype.size()
    );
    let n = inputs.len();

    macro_rules! int {
        ($t:ty) => {{
            let step: fn($t, $t) -> $t = match op {
                RedOp::Sum | RedOp::Avg => |a, b| a.wrapping_add(b),
                RedOp::Prod => |a, b| a.wrapping_mul(b),
                RedOp::Max => |a, b| a.max(b),
                RedOp::Min => |a, b| a.min(b),
            };
            // Dividing in i128 equals the type's own truncating division whenever n fits in the
            // type, and stays exact (instead of dividing by a wrapped or zero n) when it does not,
            // e.g. 256 ranks of uint8. The quotient is never larger than the sum, so it fits.
            let finish = |a: $t| if op == RedOp::Avg { (a as i128 / n as i128) as $t } else { a };
            fold(inputs, <$t>::from_le_bytes, <$t>::to_le_bytes, step, finish)
        }};
    }

    match dtype {
        DataType::Int8 => int!(i8),
        DataType::Uint8 => int!(u8),
        DataType::Int32 => int!(i32),
        DataType::Uint32 => int!(u32),
        DataType::Int64 => int!(i64),
        DataType::Uint64 => int!(u64),
        DataType::Float32 => {
            let finish = |a: f32| if op == RedOp::Avg { a / n as f32 } else { a };
            fold(inputs, f32::from_le_bytes, f32::to_le_bytes, float_step::<f32>(op), finish)
        }
        DataType::Float64 => {
            let finish = |a: f64| if op == RedOp::Avg { a / n as f64 } else { a };
            fold(inputs, f64::from_le_bytes, f64::to_le_bytes, float_step::<f64>(op), finish)
        }
        DataType::Float16 => fold_narrow(inputs, op, f16_to_f32, f32_to_f16),
        DataType::Bfloat16 => fold_narrow(inputs, op, bf16_to_f32, f32_to_bf16),
        DataType::Float8E4M3 | DataType::Float8E5M2 => fold_fp8(inputs, op, dtype),
    }
}

/// The fold for the fp8 types, as NCCL computes them (`fp8`): each step through `half`. Their
/// average is NCCL's too: a pre-multiplied sum with the scalar 1/n rounded to the type
/// (`fp8_avg_scalar`), not a division at the end, so it saturates only where the result does.
fn fold_fp8(inputs: &[&[u8]], op: RedOp, dtype: DataType) -> Vec<u8> {
    let f = dtype.fp8().expect("an fp8 type");
    if op == RedOp::Avg {
        let s = fp8_avg_scalar(dtype, inputs.len()).expect("an fp8 type") as u64;
        let scaled: Vec<Vec<u8>> = inputs.iter().map(|x| premul_reference(dtype, s, x)).collect();
        let refs: Vec<&[u8]> = scaled.iter().map(Vec::as_slice).collect();
        return fold_fp8(&refs, RedOp::Sum, dtype);
    }
    let step = float_step::<f32>(op);
    fold(inputs, u8::from_le_bytes, u8::to_le_bytes, |a, b| f.step(step(f.to_f32(a), f.to_f32(b))), |a| a)
}

/// The scalar NCCL averages an fp8 type with on `n` ranks (a pre-multiplied sum): 1/n rounded
/// to the type, saturating; `None` for other types.
pub fn fp8_avg_scalar(dtype: DataType, n: usize) -> Option<u8> {
    dtype.fp8().map(|f| f.from_f64_satfinite(f64::from((1.0 / n as f64) as f32)))
}

/// The per-step floating-point operation; `Avg` steps are sums, its division comes at the end.
/// Max / min replace the accumulator only on a strict comparison, so ties and NaN keep it.
fn float_step<T>(op: RedOp) -> fn(T, T) -> T
where
    T: Copy + PartialOrd + std::ops::Add<Output = T> + std::ops::Mul<Output = T>,
{
    match op {
        RedOp::Sum | RedOp::Avg => |a, b| a + b,
        RedOp::Prod => |a, b| a * b,
        RedOp::Max => |a, b| if b > a { b } else { a },
        RedOp::Min => |a, b| if b < a { b } else { a },
    }
}

/// The fold for the 16-bit float types: elements stay as bits, each step goes through `f32`.
fn fold_narrow(inputs: &[&[u8]], op: RedOp, widen: fn(u16) -> f32, narrow: fn(f32) -> u16) -> Vec<u8> {
    let n = inputs.len();
    let step = float_step::<f32>(op);
    let finish = |a: u16| if op == RedOp::Avg { narrow(widen(a) / n as f32) } else { a };
    fold(inputs, u16::from_le_bytes, u16::to_le_bytes, |a, b| narrow(step(widen(a), widen(b))), finish)
}

/// Folds every element position over the inputs in rank order, then applies `finish`. The
/// caller has checked that all inputs have the same length, a multiple of `W`.
fn fold<T: Copy, const W: usize>(
    inputs: &[&[u8]],
    decode: fn([u8; W]) -> T,
    encode: fn(T) -> [u8; W],
    step: impl Fn(T, T) -> T,
    finish: impl Fn(T) -> T,
) -> Vec<u8> {
    let len = inputs[0].len();
    let read = |input: &[u8], off: usize| {
        let mut b = [0u8; W];
        b.copy_from_slice(&input[off..off + W]);
        decode(b)
    };
    let mut out = Vec::with_capacity(len);
    for off in (0..len).step_by(W) {
        let mut acc = read(inputs[0], off);
        for input in &inputs[1..] {
            acc = step(acc, read(input, off));
        }
        out.extend_from_slice(&encode(finish(acc)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;

    fn enc<T: Copy, const W: usize>(v: &[T], f: fn(T) -> [u8; W]) -> Vec<u8> {
        v.iter().flat_map(|&x| f(x)).collect()
    }

    fn dec<T, const W: usize>(b: &[u8], f: fn([u8; W]) -> T) -> Vec<T> {
        b.chunks_exact(W)
            .map(|c| {
                let mut a = [0u8; W];
                a.copy_from_slice(c);
                f(a)
            })
            .collect()
    }

    /// Reduces typed inputs and decodes the typed result.
    fn red<T: Copy, const W: usize>(dtype: DataType, op: RedOp, inputs: &[&[T]], to: fn(T) -> [u8; W], from: fn([u8; W]) -> T) -> Vec<T> {
        assert_eq!(dtype.size(), W);
        let bytes: Vec<Vec<u8>> = inputs.iter().map(|v| enc(v, to)).collect();
        let refs: Vec<&[u8]> = bytes.iter().map(|b| b.as_slice()).collect();
        let out = reduce_reference(dtype, op, &refs);
        assert_eq!(out.len(), refs[0].len());
        dec(&out, from)
    }

    fn h(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| f32_to_f16(x)).collect()
    }

    fn bf(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| f32_to_bf16(x)).collect()
    }

    fn red_h(op: RedOp, inputs: &[&[f32]]) -> Vec<f32> {
        let hs: Vec<Vec<u16>> = inputs.iter().map(|v| h(v)).collect();
        let refs: Vec<&[u16]> = hs.iter().map(|v| v.as_slice()).collect();
        red(DataType::Float16, op, &refs, u16::to_le_bytes, u16::from_le_bytes).into_iter().map(f16_to_f32).collect()
    }

    fn red_bf(op: RedOp, inputs: &[&[f32]]) -> Vec<f32> {
        let bs: Vec<Vec<u16>> = inputs.iter().map(|v| bf(v)).collect();
        let refs: Vec<&[u16]> = bs.iter().map(|v| v.as_slice()).collect();
        red(DataType::Bfloat16, op, &refs, u16::to_le_bytes, u16::from_le_bytes).into_iter().map(bf16_to_f32).collect()
    }

    // ---- names and NCCL values

    /// Reads one element back as f64 (integers signed or not as the type is).
    fn element_value(t: DataType, b: &[u8]) -> f64 {
        match t {
            DataType::Int8 => f64::from(b[0] as i8),
            DataType::Uint8 => f64::from(b[0]),
            DataType::Int32 => f64::from(i32::from_le_bytes(b.try_into().unwrap())),
            DataType::Uint32 => f64::from(u32::from_le_bytes(b.try_into().unwrap())),
            DataType::Int64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
            DataType::Uint64 => u64::from_le_bytes(b.try_into().unwrap()) as f64,
            DataType::Float16 => f64::from(f16_to_f32(u16::from_le_bytes(b.try_into().unwrap()))),
            DataType::Bfloat16 => f64::from(bf16_to_f32(u16::from_le_bytes(b.try_into().unwrap()))),
            DataType::Float32 => f64::from(f32::from_le_bytes(b.try_into().unwrap())),
            DataType::Float64 => f64::from_le_bytes(b.try_into().unwrap()),
            DataType::Float8E4M3 | DataType::Float8E5M2 => f64::from(t.fp8().unwrap().to_f32(b[0])),
        }
    }

    #[test]
    fn small_integers_are_exact_in_every_type() {
        for t in DataType::ALL {
            for v in -8..=8i64 {
                let mut out = vec![0xee];
                t.push_integer(v, &mut out);
                assert_eq!(out.len(), 1 + t.size(), "{t:?} appends one element");
                let back = element_value(t, &out[1..]);
                let unsigned = matches!(t, DataType::Uint8 | DataType::Uint32 | DataType::Uint64);
                if unsigned && v < 0 {
                    // Wrapped: the type's modulus above zero.
                    let modulus = 2f64.powi(8 * t.size() as i32);
                    assert_eq!(back, modulus + v as f64, "{t:?} {v}");
                } else {
                    assert_eq!(back, v as f64, "{t:?} {v}");
                }
            }
        }
        // Beyond a type's range: low bits for integers, saturation for fp8.
        let mut out = Vec::new();
        DataType::Int8.push_integer(300, &mut out);
        DataType::Float8E4M3.push_integer(1000, &mut out);
        assert_eq!(out, [300u16 as u8, 0x7e], "e4m3's largest finite, 448");
    }

    #[test]
    fn datatype_tables() {
        let sizes = [1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1];
        for (i, t) in DataType::ALL.into_iter().enumerate() {
            assert_eq!(t.nccl(), i as i32);
            assert_eq!(DataType::from_nccl(t.nccl()), Ok(t));
            assert_eq!(t.size(), sizes[i]);
            assert_eq!(DataType::parse(t.name()), Some(t));
        }
        assert_eq!(DataType::Float16.name(), "half");
        assert_eq!(DataType::Bfloat16.kernel_tag(), "bf16");
        for (alias, t) in [
            ("char", DataType::Int8),
            ("int", DataType::Int32),
            ("float16", DataType::Float16),
            ("float32", DataType::Float32),
            ("float64", DataType::Float64),
            ("bf16", DataType::Bfloat16),
            ("fp8_e4m3", DataType::Float8E4M3),
            ("e5m2", DataType::Float8E5M2),
        ] {
            assert_eq!(DataType::parse(alias), Some(t));
        }
        assert_eq!(DataType::Float8E4M3.name(), "f8e4m3", "nccl-tests' name");
        assert_eq!(DataType::parse("fp8"), None, "which of the two is not said");
        assert_eq!(DataType::parse(""), None);
        let floats: Vec<DataType> = DataType::ALL.into_iter().filter(|t| t.is_float()).collect();
        assert_eq!(
            floats,
            [DataType::Float16, DataType::Float32, DataType::Float64, DataType::Bfloat16, DataType::Float8E4M3, DataType::Float8E5M2]
        );
        let narrow: Vec<DataType> = DataType::ALL.into_iter().filter(|t| t.is_narrow_float()).collect();
        assert_eq!(narrow, [DataType::Float16, DataType::Bfloat16, DataType::Float8E4M3, DataType::Float8E5M2]);
    }

    #[test]
    fn fp8_steps_through_half_and_averages_as_a_premultiplied_sum() {
        let e4 = |v: f64| Fp8::E4M3.from_f64_satfinite(v);
        let r = |op, ins: &[&[u8]]| reduce_reference(DataType::Float8E4M3, op, ins);
        // 448 + 448 saturates to 448; the average of two 448s is 448 · 0.5 + 448 · 0.5, where
        // a division after the sum would give 224.
        assert_eq!(r(RedOp::Sum, &[&[e4(448.0)], &[e4(448.0)]]), [e4(448.0)]);
        assert_eq!(r(RedOp::Avg, &[&[e4(448.0)], &[e4(448.0)]]), [e4(448.0)]);
        // Three ranks: 1/3 rounds to 0.34375; 0.34375 + 0.6875 = 1.03125 rounds to 1, and
        // 1 + 1.375 = 2.375 to the even 2.5.
        assert_eq!(fp8_avg_scalar(DataType::Float8E4M3, 3), Some(e4(0.34375)));
        assert_eq!(r(RedOp::Avg, &[&[e4(1.0)], &[e4(2.0)], &[e4(4.0)]]), [e4(2.5)]);
        assert_eq!(fp8_avg_scalar(DataType::Float32, 3), None);
        // Ranks fold in order, each step rounded: (1 + 0.0625) rounds back to 1 twice, where
        // 0.0625 + 0.0625 first would have reached 1.125.
        assert_eq!(r(RedOp::Sum, &[&[e4(1.0)], &[e4(0.0625)], &[e4(0.0625)]]), [e4(1.0)]);
        assert_eq!(r(RedOp::Max, &[&[e4(-3.0)], &[e4(0.5)]]), [e4(0.5)]);
        let e5 = |v: f64| Fp8::E5M2.from_f64_satfinite(v);
        assert_eq!(reduce_reference(DataType::Float8E5M2, RedOp::Prod, &[&[e5(256.0)], &[e5(512.0)]]), [e5(57344.0)]);
        assert_eq!(premul_reference(DataType::Float8E5M2, e5(0.5).into(), &[e5(3.0), e5(-1.5)]), [e5(1.5), e5(-0.75)]);
    }

    #[test]
    fn datatype_from_nccl_errors() {
        // 12 is ncclNumTypes.
        for v in [-1, 12, i32::MAX] {
            let e = DataType::from_nccl(v).unwrap_err();
            assert_eq!(e.status(), Status::InvalidParam);
            assert!(e.message().contains(&v.to_string()), "{e:?}");
        }
    }

    #[test]
    fn premul_scales_like_a_product_step() {
        let ints: Vec<u8> = [3i32, -4, i32::MAX].iter().flat_map(|v| v.to_le_bytes()).collect();
        let out = premul_reference(DataType::Int32, 2u64, &ints);
        let got: Vec<i32> = out.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, [6, -8, i32::MAX.wrapping_mul(2)]);
        let f: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let out = premul_reference(DataType::Float32, u64::from(0.5f32.to_bits()), &f);
        assert_eq!(out, [0.75f32, -1.0].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
        let h = f32_to_f16(3.0).to_le_bytes();
        let out = premul_reference(DataType::Float16, u64::from(f32_to_f16(0.25)), &h);
        assert_eq!(f16_to_f32(u16::from_le_bytes([out[0], out[1]])), 0.75);
    }

    #[test]
    fn redop_tables() {
        for (i, op) in RedOp::ALL.into_iter().enumerate() {
            assert_eq!(op.nccl(), i as i32);
            assert_eq!(RedOp::from_nccl(op.nccl()), Ok(op));
            assert_eq!(RedOp::parse(op.name()), Some(op));
            assert_eq!(op.kernel_tag(), op.name());
        }
        assert_eq!(RedOp::Avg.name(), "avg");
        assert_eq!(RedOp::parse("mean"), None);
        for v in [-1, 5, 1000] {
            let e = RedOp::from_nccl(v).unwrap_err();
            assert_eq!(e.status(), Status::InvalidParam);
            assert!(e.message().contains(&v.to_string()), "{e:?}");
        }
    }

    // ---- conversions

    #[test]
    fn f16_known_values() {
        for (f, bits) in [
            (1.0f32, 0x3c00u16),
            (-2.5, 0xc100),
            (65504.0, 0x7bff),
            (2f32.powi(-14), 0x0400),
            (2f32.powi(-24), 0x0001),
            (1023.0 * 2f32.powi(-24), 0x03ff),
            (0.0, 0x0000),
            (-0.0, 0x8000),
            (f32::INFINITY, 0x7c00),
            (f32::NEG_INFINITY, 0xfc00),
        ] {
            assert_eq!(f32_to_f16(f), bits, "{f}");
            assert_eq!(f16_to_f32(bits).to_bits(), f.to_bits(), "{bits:#06x}");
        }
        // Overflow: 65520 is the tie between 65504 (odd mantissa) and 65536, so it rounds up to inf.
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(65519.99), 0x7bff);
        assert_eq!(f32_to_f16(-1e10), 0xfc00);
        assert_eq!(f32_to_f16(f32::MAX), 0x7c00);
        // Underflow: anything at or below half the smallest subnormal is zero, sign kept.
        assert_eq!(f32_to_f16(2f32.powi(-26)), 0x0000);
        assert_eq!(f32_to_f16(-f32::from_bits(1)), 0x8000);
    }

    #[test]
    fn f16_nan() {
        assert!(f16_to_f32(0x7e00).is_nan());
        assert!(f16_to_f32(0xfc01).is_nan());
        let n = f32_to_f16(f32::NAN);
        assert_eq!(n & 0x7c00, 0x7c00);
        assert_ne!(n & 0x3ff, 0);
        // A NaN whose payload is only in the low bits f16 drops must not become infinity.
        assert!(f16_to_f32(f32_to_f16(f32::from_bits(0x7f80_0001))).is_nan());
        assert!(f16_to_f32(f32_to_f16(f32::from_bits(0xff80_0001))).is_nan());
    }

    #[test]
    fn f16_round_to_nearest_even() {
        let ulp = 2f32.powi(-10);
        // Ties between 1.0 (even) and 1+ulp (odd) go down; between 1+ulp and 1+2ulp go up.
        assert_eq!(f32_to_f16(1.0 + ulp / 2.0), 0x3c00);
        assert_eq!(f32_to_f16(1.0 + 1.5 * ulp), 0x3c02);
        // Just past the tie goes up.
        assert_eq!(f32_to_f16(f32::from_bits((1.0f32 + ulp / 2.0).to_bits() + 1)), 0x3c01);
        assert_eq!(f32_to_f16(2049.0), f32_to_f16(2048.0));
        assert_eq!(f32_to_f16(2051.0), f32_to_f16(2052.0));
        // Subnormal ties: 0.5 and 1.5 units of 2^-24.
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0x0000);
        assert_eq!(f32_to_f16(3.0 * 2f32.powi(-25)), 0x0002);
        assert_eq!(f32_to_f16(f32::from_bits(2f32.powi(-25).to_bits() + 1)), 0x0001);
        // Rounding out of the subnormal range into the smallest normal.
        assert_eq!(f32_to_f16(1023.5 * 2f32.powi(-24)), 0x0400);
    }

    #[test]
    fn f16_every_value_round_trips() {
        for bits in 0..=u16::MAX {
            let f = f16_to_f32(bits);
            if f.is_nan() {
                assert!(f16_to_f32(f32_to_f16(f)).is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(f32_to_f16(f), bits, "{bits:#06x}");
            }
        }
    }

    /// Independent check of rounding: over a sweep of f32 values, the result is a nearest half
    /// value, and on a tie the even one.
    #[test]
    fn f16_rounding_is_nearest() {
        let mut x: u32 = 0;
        while x < 0x4780_0000 {
            let f = f32::from_bits(x);
            let r = f32_to_f16(f);
            let got = f64::from(f16_to_f32(r));
            let want = f64::from(f);
            if r < 0x7bff {
                let up = f64::from(f16_to_f32(r + 1));
                let d = (got - want).abs();
                let du = (up - want).abs();
                assert!(d < du || (d == du && r & 1 == 0), "{f:e}: {r:#06x}");
            }
            if r > 0 && r < 0x7c00 {
                let down = f64::from(f16_to_f32(r - 1));
                let d = (got - want).abs();
                let dd = (down - want).abs();
                assert!(d < dd || (d == dd && r & 1 == 0), "{f:e}: {r:#06x}");
            }
            x += 0x0fff;
        }
    }

    #[test]
    fn bf16_known_values() {
        for (f, bits) in [(1.0f32, 0x3f80u16), (-2.5, 0xc020), (0.0, 0x0000), (-0.0, 0x8000), (f32::INFINITY, 0x7f80)] {
            assert_eq!(f32_to_bf16(f), bits, "{f}");
            assert_eq!(bf16_to_f32(bits).to_bits(), f.to_bits());
        }
        assert_eq!(bf16_to_f32(0x0001), f32::from_bits(0x0001_0000));
        // Round to nearest even on the dropped 16 bits.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_7fff)), 0x3f80);
        assert_eq!(f32_to_bf16(257.0), f32_to_bf16(256.0));
        // Overflow to infinity.
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(f32_to_bf16(f32::MIN), 0xff80);
    }

    #[test]
    fn bf16_nan_stays_quiet_nan() {
        for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001), f32::from_bits(0xffbf_ffff)] {
            let b = f32_to_bf16(nan);
            assert!(bf16_to_f32(b).is_nan(), "{:#010x} -> {b:#06x}", nan.to_bits());
            assert_ne!(b & 0x0040, 0, "quiet bit");
        }
    }

    // ---- reduce_reference: integers

    #[test]
    fn reduce_int8() {
        let r = |op, v: &[&[i8]]| red(DataType::Int8, op, v, i8::to_le_bytes, i8::from_le_bytes);
        assert_eq!(r(RedOp::Sum, &[&[100, 1, -128], &[100, 2, -1]]), [-56, 3, 127]);
        assert_eq!(r(RedOp::Prod, &[&[16, -3], &[16, 5]]), [0, -15]);
        assert_eq!(r(RedOp::Max, &[&[-5, 7], &[-3, -8], &[-4, 0]]), [-3, 7]);
        assert_eq!(r(RedOp::Min, &[&[-5, 7], &[-3, -8], &[-4, 0]]), [-5, -8]);
        // Avg truncates toward zero, after the sum wrapped.
        assert_eq!(r(RedOp::Avg, &[&[7, -7, 100], &[8, -8, 100]]), [7, -7, -28]);
    }

    #[test]
    fn reduce_uint8() {
        let r = |op, v: &[&[u8]]| red(DataType::Uint8, op, v, u8::to_le_bytes, u8::from_le_bytes);
        assert_eq!(r(RedOp::Sum, &[&[200, 1], &[100, 2]]), [44, 3]);
        assert_eq!(r(RedOp::Prod, &[&[16, 3], &[17, 5]]), [16, 15]);
        assert_eq!(r(RedOp::Max, &[&[255, 0], &[1, 9]]), [255, 9]);
        assert_eq!(r(RedOp::Min, &[&[255, 0], &[1, 9]]), [1, 0]);
        // 255 + 255 + 3 wraps to 1, and 1 / 3 truncates to 0.
        assert_eq!(r(RedOp::Avg, &[&[255, 10], &[255, 11], &[3, 12]]), [0, 11]);
    }

    #[test]
    fn reduce_avg_more_ranks_than_the_type_holds() {
        // 256 ranks of uint8: n does not fit in u8, the quotient is still the exact truncation.
        let ones = [1u8, 255];
        let zeros = [0u8, 0];
        let mut v: Vec<&[u8]> = vec![&ones];
        v.extend(std::iter::repeat_n(&zeros[..], 255));
        assert_eq!(red(DataType::Uint8, RedOp::Avg, &v, u8::to_le_bytes, u8::from_le_bytes), [0, 0]);
        // 128 ranks of int8: -128 / 128 = -1.
        let min = [-128i8];
        let zero = [0i8];
        let mut v: Vec<&[i8]> = vec![&min];
        v.extend(std::iter::repeat_n(&zero[..], 127));
        assert_eq!(red(DataType::Int8, RedOp::Avg, &v, i8::to_le_bytes, i8::from_le_bytes), [-1]);
    }

    #[test]
    fn reduce_int32_uint32() {
        let r = |op, v: &[&[i32]]| red(DataType::Int32, op, v, i32::to_le_bytes, i32::from_le_bytes);
        assert_eq!(r(RedOp::Sum, &[&[i32::MAX, -1], &[1, -2]]), [i32::MIN, -3]);
        assert_eq!(r(RedOp::Prod, &[&[65536, -4], &[65536, 5]]), [0, -20]);
        assert_eq!(r(RedOp::Max, &[&[-1, 3], &[-2, 4]]), [-1, 4]);
        assert_eq!(r(RedOp::Min, &[&[-1, 3], &[-2, 4]]), [-2, 3]);
        assert_eq!(r(RedOp::Avg, &[&[7, -7], &[8, -8], &[-20, 20]]), [-1, 1]);

        // Unsigned comparison: 0xffff_ffff is the largest, not -1.
        let r = |op, v: &[&[u32]]| red(DataType::Uint32, op, v, u32::to_le_bytes, u32::from_le_bytes);
        assert_eq!(r(RedOp::Max, &[&[u32::MAX, 5], &[0, 6]]), [u32::MAX, 6]);
        assert_eq!(r(RedOp::Min, &[&[u32::MAX, 5], &[0, 6]]), [0, 5]);
        assert_eq!(r(RedOp::Sum, &[&[u32::MAX, 5], &[2, 6]]), [1, 11]);
        assert_eq!(r(RedOp::Prod, &[&[1 << 31, 5], &[2, 6]]), [0, 30]);
        assert_eq!(r(RedOp::Avg, &[&[u32::MAX, 5], &[1, 6]]), [0, 5]);
    }

    #[test]
    fn reduce_int64_uint64() {
        let r = |op, v: &[&[i64]]| red(DataType::Int64, op, v, i64::to_le_bytes, i64::from_le_bytes);
        assert_eq!(r(RedOp::Sum, &[&[i64::MIN, 1 << 40], &[-1, 1 << 40]]), [i64::MAX, 1 << 41]);
        assert_eq!(r(RedOp::Prod, &[&[1 << 32, -3], &[1 << 32, 1 << 40]]), [0, -3 << 40]);
        assert_eq!(r(RedOp::Max, &[&[i64::MIN, 0], &[-1, 0]]), [-1, 0]);
        assert_eq!(r(RedOp::Min, &[&[i64::MIN, 0], &[-1, 0]]), [i64::MIN, 0]);
        assert_eq!(r(RedOp::Avg, &[&[-9, 10], &[0, 0], &[0, 0], &[0, 0]]), [-2, 2]);

        let r = |op, v: &[&[u64]]| red(DataType::Uint64, op, v, u64::to_le_bytes, u64::from_le_bytes);
        assert_eq!(r(RedOp::Sum, &[&[u64::MAX], &[u64::MAX]]), [u64::MAX - 1]);
        assert_eq!(r(RedOp::Prod, &[&[1 << 63], &[2]]), [0]);
        assert_eq!(r(RedOp::Max, &[&[u64::MAX], &[1]]), [u64::MAX]);
        assert_eq!(r(RedOp::Min, &[&[u64::MAX], &[1]]), [1]);
        assert_eq!(r(RedOp::Avg, &[&[u64::MAX], &[u64::MAX - 2]]), [u64::MAX / 2 - 1]);
    }

    // ---- reduce_reference: floats

    #[test]
    fn reduce_float32() {
        let r = |op, v: &[&[f32]]| red(DataType::Float32, op, v, f32::to_le_bytes, f32::from_le_bytes);
        // Rank order matters: (1e8 + 1) rounds back to 1e8, so the sum is 0, not 1.
        assert_eq!(r(RedOp::Sum, &[&[1e8, 0.5], &[1.0, 0.25], &[-1e8, 0.125]]), [0.0, 0.875]);
        assert_eq!(r(RedOp::Sum, &[&[1e8], &[-1e8], &[1.0]]), [1.0]);
        assert_eq!(r(RedOp::Prod, &[&[-2.0, 3.0], &[1.5, 0.5]]), [-3.0, 1.5]);
        assert_eq!(r(RedOp::Avg, &[&[1.0, -1.0], &[2.0, 0.0], &[4.0, 0.0]]), [7.0f32 / 3.0, -1.0 / 3.0]);
        assert_eq!(r(RedOp::Max, &[&[1.0, -5.0], &[2.0, -6.0]]), [2.0, -5.0]);
        assert_eq!(r(RedOp::Min, &[&[1.0, -5.0], &[2.0, -6.0]]), [1.0, -6.0]);
    }

    #[test]
    fn reduce_float_max_min_keep_the_accumulator() {
        let r = |op, v: &[&[f32]]| red(DataType::Float32, op, v, f32::to_le_bytes, f32::from_le_bytes);
        for op in [RedOp::Max, RedOp::Min] {
            // Equal values: the earlier rank's zero wins, whatever its sign.
            let out = r(op, &[&[0.0, -0.0], &[-0.0, 0.0]]);
            let bits: Vec<u32> = out.iter().map(|f| f.to_bits()).collect();
            assert_eq!(bits, [0.0f32.to_bits(), (-0.0f32).to_bits()], "{op:?}");
            // NaN first: it stays; NaN later: ignored.
            let out = r(op, &[&[f32::NAN, 1.0], &[1.0, f32::NAN], &[2.0, 2.0]]);
            assert!(out[0].is_nan(), "{op:?}");
            assert_eq!(out[1], if op == RedOp::Max { 2.0 } else { 1.0 }, "{op:?}");
        }

        let r = |op, v: &[&[f64]]| red(DataType::Float64, op, v, f64::to_le_bytes, f64::from_le_bytes);
        let out = r(RedOp::Min, &[&[-0.0], &[0.0]]);
        assert_eq!(out[0].to_bits(), (-0.0f64).to_bits());
        assert!(r(RedOp::Max, &[&[f64::NAN], &[1.0]])[0].is_nan());
        assert_eq!(r(RedOp::Max, &[&[1.0], &[f64::NAN]]), [1.0]);
    }

    #[test]
    fn reduce_float64() {
        let r = |op, v: &[&[f64]]| red(DataType::Float64, op, v, f64::to_le_bytes, f64::from_le_bytes);
        assert_eq!(r(RedOp::Sum, &[&[1e16, 0.1], &[1.0, 0.2], &[-1e16, 0.3]]), [0.0, 0.1 + 0.2 + 0.3]);
        assert_eq!(r(RedOp::Prod, &[&[-2.0], &[0.5], &[3.0]]), [-3.0]);
        assert_eq!(r(RedOp::Avg, &[&[1.0], &[2.0], &[4.0]]), [7.0 / 3.0]);
        assert_eq!(r(RedOp::Max, &[&[-1.0], &[-2.0]]), [-1.0]);
        assert_eq!(r(RedOp::Min, &[&[-1.0], &[-2.0]]), [-2.0]);
    }

    #[test]
    fn reduce_half_rounds_every_step() {
        // Exact 2050 is a half value, but 2048 + 1 = 2049 rounds (tie, even) to 2048 at each step.
        assert_eq!(red_h(RedOp::Sum, &[&[2048.0], &[1.0], &[1.0]]), [2048.0]);
        // In another order the ones add up first.
        assert_eq!(red_h(RedOp::Sum, &[&[1.0], &[1.0], &[2048.0]]), [2050.0]);
        // Overflow to infinity.
        assert_eq!(red_h(RedOp::Sum, &[&[65504.0, -1.0], &[16.0, -2.5]]), [f32::INFINITY, -3.5]);
        assert_eq!(red_h(RedOp::Prod, &[&[-2.0, 300.0], &[1.5, 300.0]]), [-3.0, f32::INFINITY]);
        // 1.1 * 1.1 in half: product of the rounded inputs, rounded again.
        let p = f16_to_f32(f32_to_f16(f16_to_f32(f32_to_f16(1.1)) * f16_to_f32(f32_to_f16(1.1))));
        assert_eq!(red_h(RedOp::Prod, &[&[1.1], &[1.1]]), [p]);
        assert_eq!(red_h(RedOp::Max, &[&[-1.0, 0.5], &[-2.0, 0.75]]), [-1.0, 0.75]);
        assert_eq!(red_h(RedOp::Min, &[&[-1.0, 0.5], &[-2.0, 0.75]]), [-2.0, 0.5]);
        // Avg: rounded sum 2048, then 2048 / 3 rounded to half (spacing 0.5 there).
        assert_eq!(red_h(RedOp::Avg, &[&[2048.0, 1.0], &[1.0, 2.0], &[1.0, 0.0]]), [682.5, 1.0]);
        let nan = red_h(RedOp::Max, &[&[f32::NAN], &[1.0]]);
        assert!(nan[0].is_nan());
    }

    #[test]
    fn reduce_bfloat16_rounds_every_step() {
        // bf16 has 8 significant bits: 256 + 1 rounds (tie, even) to 256 each time.
        assert_eq!(red_bf(RedOp::Sum, &[&[256.0], &[1.0], &[1.0]]), [256.0]);
        assert_eq!(red_bf(RedOp::Sum, &[&[1.0], &[1.0], &[256.0]]), [258.0]);
        assert_eq!(red_bf(RedOp::Prod, &[&[-2.0], &[1.5], &[0.25]]), [-0.75]);
        assert_eq!(red_bf(RedOp::Max, &[&[-1.0, 3.0], &[-2.0, 1e30]]), [-1.0, bf16_to_f32(f32_to_bf16(1e30))]);
        assert_eq!(red_bf(RedOp::Min, &[&[-1.0, 3.0], &[-2.0, 1e30]]), [-2.0, 3.0]);
        // Sum 256 (rounded as above), / 3 = 85.33 rounded to bf16 (spacing 0.5 in [64, 128)).
        assert_eq!(red_bf(RedOp::Avg, &[&[256.0], &[1.0], &[1.0]]), [85.5]);
        assert_eq!(red_bf(RedOp::Avg, &[&[1.0], &[2.0]]), [1.5]);
    }

    #[test]
    fn reduce_single_input_is_identity() {
        // No NaN patterns among these bytes, so even float Avg (a division by 1) keeps every bit.
        let input: Vec<u8> = (0u8..64).collect();
        for dtype in DataType::ALL {
            for op in RedOp::ALL {
                assert_eq!(reduce_reference(dtype, op, &[&input]), input, "{dtype:?} {op:?}");
            }
        }
    }

    #[test]
    fn reduce_empty_buffers() {
        for dtype in DataType::ALL {
            for op in RedOp::ALL {
                assert!(reduce_reference(dtype, op, &[&[], &[]]).is_empty());
            }
        }
    }

    #[test]
    #[should_panic(expected = "input 1 is 4 bytes, input 0 is 8")]
    fn reduce_panics_on_mismatched_lengths() {
        reduce_reference(DataType::Int32, RedOp::Sum, &[&[0; 8], &[0; 4]]);
    }

    #[test]
    #[should_panic(expected = "not a whole number of float elements")]
    fn reduce_panics_on_partial_element() {
        reduce_reference(DataType::Float32, RedOp::Sum, &[&[0; 6], &[0; 6]]);
    }

    #[test]
    #[should_panic(expected = "no inputs")]
    fn reduce_panics_on_no_inputs() {
        reduce_reference(DataType::Uint8, RedOp::Max, &[]);
    }
}
