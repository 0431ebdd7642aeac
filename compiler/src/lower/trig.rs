//! `sin` and `cos` of f32 values as XLA:CPU's vector code can run them.
//!
//! XLA:CPU lowers `stablehlo.sine`/`cosine` to libm's scalar `sinf`/`cosf`, called once per
//! lane from otherwise vectorized loops (8 calls per 8-wide vector, each unpacking and packing a
//! lane): a `[262144]` cos and sin pair ran 2.2 ms where eager's vectorized kernels take 0.7 on
//! one thread. Here the argument reduction and polynomials are plain arithmetic, which XLA
//! fuses and vectorizes (large tensors only: `VECTOR_TRIG_MIN_ELEMENTS`).
//!
//! The reduction is exact over the whole f32 range (Payne-Hanek in f64, with a table in place of
//! the bit-window arithmetic): `|x| = m · 2^s` with `m` the 24-bit integer mantissa, and
//! `|x| · 2/π mod 4 = m · c(s) mod 4` for `c(s) = 2^s · 2/π mod 4`, looked up by the biased
//! exponent and held as three f64 parts. The first two parts have few enough bits that their
//! products with `m` are exact, so the quadrant and the remainder lose nothing to cancellation,
//! even for the f32 values nearest a multiple of π/2; the polynomials run on `|r| ≤ π/4` in f64.
//! Below 2^24, `c(s)` is 2/π's own parts scaled, so `m · c(s)` is `|x|` times them and the loop
//! needs no lookup (Fourier features, 524288 of each function: 1.05-1.12 ms against 1.88-2.01
//! with three table loads an element); the table's form runs only for a tensor holding a finite
//! |x| ≥ 2^24, in a `while` of one trip after a max-reduce finds one.
//! Results are f32's correctly rounded values but for f64's own rounding (0.5001 ulp at most
//! over 9 M arguments, |x| from 1e-3 to 3e38, against eager's 0.6: glibc's and Sleef's are
//! within 1 ulp).

use super::builder::{Builder, Combiner, IndexMap, Scalar, Val, R};
use crate::ir::DType;

/// Elements from which `sin`/`cos` take this form. It is ~45 operations an element where
/// libm's call counted as one, so XLA's cost model splits its loop across two threads, and on
/// smaller tensors waking the second costs more than it saves. Steady calls on the CPU plugin
/// (2 vCPUs), libm's form against this one, µs: cos and sin of `[8192]` 68 / 77-85, `[16384]`
/// 110 / 113-124 (a RoPE-like `[1, 256, 64]` pair 105 / 100-105); from `[32768]` on this one is
/// faster: 365 / 125, RoPE-like 183 / 125, `sin(2x + 1) · cos(x)` 507 / 124-130; `[65536]` 725-753
/// / 161-208; `[131072]` 1379-1473 / 251-255.
pub const VECTOR_TRIG_MIN_ELEMENTS: i64 = 1 << 15;

/// The bits of 2/π after the binary point, 32 at a time (0.A2F9836E…).
const TWO_OVER_PI: [u32; 10] = [
    0xA2F9836E, 0x4E441529, 0xFC2757D1, 0xF534DDC0, 0xDB629599, 0x3C439041, 0xFE5163AB,
    0xDEBBC561, 0xB7246E3A, 0x424DD2E0,
];

/// Taylor coefficients of sin(r)/r and cos(r) in r²: to r¹¹ and r¹², below 1e-11 relative on
/// |r| ≤ π/4 (f32's half ulp is 3e-8).
const SIN: [f64; 6] = [1.0, -1.0 / 6.0, 1.0 / 120.0, -1.0 / 5040.0, 1.0 / 362880.0, -1.0 / 39916800.0];
const COS: [f64; 7] = [
    1.0,
    -1.0 / 2.0,
    1.0 / 24.0,
    -1.0 / 720.0,
    1.0 / 40320.0,
    -1.0 / 3628800.0,
    1.0 / 479001600.0,
];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Trig {
    Sin,
    Cos,
}

/// `sin(x)` or `cos(x)` of an f32 tensor: the form without the table, which holds below 2^24,
/// and, only when some |x| is larger (and finite), the table's form in a loop of one trip.
pub fn sin_cos<'a>(b: &Builder<'a>, x: &Val<'a>, f: Trig) -> R<Val<'a>> {
    let quick = reduced(b, x, f, false)?;
    let exponent = biased_exponent(b, &b.bitcast(x, DType::I32)?)?;
    let int = |v: i64| b.full_like(Scalar::Int(v), &exponent);
    let beyond = b.binary(
        "and",
        &b.compare(&exponent, &int(SMALL_EXPONENTS)?, "GE")?,
        &b.compare(&exponent, &int(0xFF)?, "NE")?,
    )?;
    let all: Vec<usize> = (0..x.rank()).collect();
    let any_beyond = b.reduce(&beyond, &all, Combiner::Or, false)?;
    let state = b.while_loop(
        &[&any_beyond, x, &quick],
        |_, s| Ok(s[0].clone()),
        |b, s| Ok(vec![b.scalar(Scalar::Bool(false), DType::Bool)?, s[1].clone(), reduced(&b, &s[1], f, true)?]),
    )?;
    Ok(state[2].clone())
}

/// The biased exponent field of f32 values' `bits` (i32).
fn biased_exponent<'a>(b: &Builder<'a>, bits: &Val<'a>) -> R<Val<'a>> {
    let int = |v: i64| b.full_like(Scalar::Int(v), bits);
    b.binary("and", &b.binary("shift_right_logical", bits, &int(23)?)?, &int(0xFF)?)
}

/// Below this biased exponent (|x| < 2^24) `c = 2^s · 2/π` needs no reduction mod 4, so its
/// parts are 2/π's own scaled by 2^s, and `m · c` is `|x|` times them: no table.
const SMALL_EXPONENTS: i64 = 151;

/// `sin(x)` or `cos(x)` by the reduction described above, `c`'s parts looked up in the table
/// (any f32) or 2/π's own (exact below 2^24 only).
fn reduced<'a>(b: &Builder<'a>, x: &Val<'a>, f: Trig, table: bool) -> R<Val<'a>> {
    let int = |v: i64, like: &Val<'a>| b.full_like(Scalar::Int(v), like);
    let bits = b.bitcast(x, DType::I32)?;
    let exponent = biased_exponent(b, &bits)?;
    // Sin's parts lead with 29 bits, cos's with 28: the tables differ, so XLA keeps the two
    // lookups of one argument apart, each inside its function's loop. Merged (by CSE), the
    // lookup became a loop of its own writing its f64 parts to memory: 1.9 ms instead of 0.75
    // for the `[262144]` pair.
    let lead = if f == Trig::Sin { 29 } else { 28 };
    let (m, c1, c2, c3) = if table {
        let fraction = b.binary("and", &bits, &int(0x7F_FFFF, &bits)?)?;
        let normal = b.compare(&exponent, &int(0, &exponent)?, "NE")?;
        let implicit = b.select(&normal, &int(0x80_0000, &bits)?, &int(0, &bits)?)?;
        let m = b.convert(&b.binary("or", &fraction, &implicit)?, DType::F64)?;
        let mut idx_shape = exponent.shape().to_vec();
        idx_shape.push(1);
        let idx = b.reshape(&exponent, &idx_shape)?;
        let map = IndexMap { window_dims: vec![], collapsed: vec![0], index_to_operand: vec![0], index_vector_dim: exponent.rank() };
        let [c1, c2, c3] = reduction_table(lead).map(|column| b.gather(&b.table(&column, DType::F64)?, &idx, &map, &[1], exponent.shape().to_vec()));
        (m, c1?, c2?, c3?)
    } else {
        let m = b.convert(&b.unary("abs", x)?, DType::F64)?;
        let [c1, c2, c3] = two_over_pi_parts(lead).map(|c| b.full_like(Scalar::Float(c), &m));
        (m, c1?, c2?, c3?)
    };

    let f64c = |v: f64, like: &Val<'a>| b.full_like(Scalar::Float(v), like);
    // m · c mod 4 = high + middle + m·c3, the first two exact: q, the quadrant, is the integer
    // nearest high + middle, and the remainder (high − q) + middle + m·c3 loses only its last
    // roundings, relative to its own size.
    let high = b.mul(&m, &c1)?;
    let high = b.sub(&high, &b.mul_scalar(&b.unary("floor", &b.mul_scalar(&high, 0.25)?)?, 4.0)?)?;
    let middle = b.mul(&m, &c2)?;
    let q = b.unary("round_nearest_even", &b.add(&high, &middle)?)?;
    let fraction = b.add(&b.add(&b.sub(&high, &q)?, &middle)?, &b.mul(&m, &c3)?)?;
    let r = b.mul_scalar(&fraction, std::f64::consts::FRAC_PI_2)?;
    let quadrant = b.binary("and", &b.convert(&q, DType::I32)?, &int(3, &bits)?)?;

    let r2 = b.mul(&r, &r)?;
    let horner = |coefs: &[f64]| -> R<Val<'a>> {
        let mut acc = f64c(coefs[coefs.len() - 1], &r2)?;
        for &c in coefs[..coefs.len() - 1].iter().rev() {
            acc = b.add(&b.mul(&acc, &r2)?, &f64c(c, &r2)?)?;
        }
        Ok(acc)
    };
    let sin_r = b.mul(&r, &horner(&SIN)?)?;
    let cos_r = horner(&COS)?;
    let odd = b.compare(&b.binary("and", &quadrant, &int(1, &quadrant)?)?, &int(1, &quadrant)?, "EQ")?;
    let (on_odd, on_even) = match f {
        Trig::Sin => (&cos_r, &sin_r),
        Trig::Cos => (&sin_r, &cos_r),
    };
    let v = b.select(&odd, on_odd, on_even)?;
    let negate = match f {
        // sin(x + kπ/2) for k = 2, 3 is −sin, −cos; sin is odd in x (−0 keeps its sign).
        Trig::Sin => b.binary(
            "xor",
            &b.compare(&quadrant, &int(2, &quadrant)?, "GE")?,
            &b.compare(&bits, &int(0, &bits)?, "LT")?,
        )?,
        // cos(x + kπ/2) for k = 1, 2 is −sin, −cos; cos is even.
        Trig::Cos => b.compare(&b.binary("and", &b.add(&quadrant, &int(1, &quadrant)?)?, &int(2, &quadrant)?)?, &int(2, &quadrant)?, "EQ")?,
    };
    let v = b.convert(&b.select(&negate, &b.unary("negate", &v)?, &v)?, DType::F32)?;
    // Infinities and NaN (exponent 255): NaN, as libm gives.
    let not_finite = b.compare(&exponent, &int(0xFF, &exponent)?, "EQ")?;
    let v = b.select(&not_finite, &b.full_like(Scalar::Float(f64::NAN), &v)?, &v)?;
    if f == Trig::Cos {
        return Ok(v);
    }
    // Below 2^-12, sin(x) rounds to x. Taken as it is, x keeps its subnormal values, which
    // XLA:CPU's arithmetic (denormals flushed) would turn into 0.
    b.select(&b.compare(&exponent, &int(127 - 12, &exponent)?, "LT")?, x, &v)
}

/// Bit `j` of 2/π (bit 1 is the first after the point: 2/π = Σ bit(j) · 2^-j).
fn two_over_pi_bit(j: i64) -> u64 {
    let j = (j - 1) as usize;
    match TWO_OVER_PI.get(j / 32) {
        Some(word) => u64::from((word >> (31 - j % 32)) & 1),
        None => 0,
    }
}

/// 2/π in the parts `reduction_table` holds for s = 0.
fn two_over_pi_parts(lead: i64) -> [f64; 3] {
    reduction_table(lead).map(|column| column[150])
}

/// Per biased f32 exponent `e` (0..=255; 0, the subnormals, as 1), `c = 2^s · 2/π mod 4` for
/// `s = e - 150` in three f64 parts from its leading bit on: `lead` bits, `lead` bits, 53
/// bits. With `lead` ≤ 29 a 24-bit mantissa times either of the first two is exact in f64.
fn reduction_table(lead: i64) -> [Vec<f64>; 3] {
    let mut parts: [Vec<f64>; 3] = Default::default();
    for e in 0..=255i64 {
        let s = e.max(1) - 150;
        // c = Σ bit(j) 2^(s-j) over j ≥ max(1, s - 1): the bits above 2^1 are multiples of 4.
        let first = (s - 1).max(1);
        let mut j = (first..first + 400).find(|&j| two_over_pi_bit(j) == 1).unwrap_or(first);
        for (part, width) in parts.iter_mut().zip([lead, lead, 53]) {
            let digits = (j..j + width).fold(0u64, |acc, k| (acc << 1) | two_over_pi_bit(k));
            // digits · 2^(s - (j + width - 1)), exact: a power of two times an integer of
            // `width` ≤ 53 bits, far from f64's range limits (2^-420 at the least).
            part.push(digits as f64 * 2f64.powi((s - (j + width - 1)) as i32));
            j += width;
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts add up to 2^s · 2/π mod 4, checked in f64 where that is well inside its
    /// precision (s small: no reduction), and each part has at most its width of bits.
    #[test]
    fn table_parts_sum_to_the_scaled_constant() {
        for lead in [28, 29] {
            let [c1, c2, c3] = reduction_table(lead);
            for e in 1..=150usize {
                let s = e as i32 - 150;
                let want = 2f64.powi(s) * std::f64::consts::FRAC_2_PI;
                let got = c1[e] + c2[e] + c3[e];
                assert!((got - want).abs() <= want * 1e-15, "e {e}: {got} vs {want}");
            }
            for (part, width) in [(&c1, lead), (&c2, lead)] {
                for &v in part.iter().filter(|v| **v != 0.0) {
                    let mantissa = v.to_bits() & ((1 << 52) - 1);
                    assert!(mantissa.trailing_zeros() as i64 >= 52 - (width - 1), "{v:e} has more than {width} bits");
                }
            }
            // Large exponents: every part is below 4 and the first is not 0 (the window moved).
            for (e, &first) in c1.iter().enumerate().skip(151) {
                assert!(first > 0.0 && first < 4.0, "e {e}: {first}");
            }
        }
    }

    #[test]
    fn bits_of_two_over_pi_start_as_published() {
        // 2/π = 0.101000101111100110000011… in binary (0xA2F983…).
        let first: String = (1..=24).map(|j| if two_over_pi_bit(j) == 1 { '1' } else { '0' }).collect();
        assert_eq!(first, "101000101111100110000011");
        assert_eq!(two_over_pi_bit(400), 0);
    }
}
