//! Shapes with symbolic dimensions, and the polynomials that analyses sum them into.
//! A dimension is a rational monomial over symbols (`4`, `batch*seq`, `batch*seq*2/8`).

use crate::SymId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// An exact rational number, always in lowest terms with a positive denominator.
///
/// Dimensions are rational rather than integer so that the tokens an expert
/// receives under top-k routing (`batch*seq*k/experts`) stay exact in analyses;
/// a concrete run rounds them up when it binds the symbols.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Ratio {
    num: i128,
    den: i128,
}

fn gcd(mut a: i128, mut b: i128) -> i128 {
    a = a.abs();
    b = b.abs();
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Ratio {
    pub const ZERO: Ratio = Ratio { num: 0, den: 1 };
    pub const ONE: Ratio = Ratio { num: 1, den: 1 };

    /// `num / den`; `None` when `den` is zero.
    pub fn new(num: i128, den: i128) -> Option<Ratio> {
        if den == 0 {
            return None;
        }
        let g = gcd(num, den).max(1);
        let sign = if den < 0 { -1 } else { 1 };
        Some(Ratio {
            num: sign * num / g,
            den: sign * den / g,
        })
    }

    pub fn int(n: i64) -> Ratio {
        Ratio {
            num: n as i128,
            den: 1,
        }
    }

    pub fn numer(self) -> i128 {
        self.num
    }

    pub fn denom(self) -> i128 {
        self.den
    }

    pub fn as_int(self) -> Option<i64> {
        (self.den == 1)
            .then(|| i64::try_from(self.num).ok())
            .flatten()
    }

    pub fn to_f64(self) -> f64 {
        self.num as f64 / self.den as f64
    }

    pub fn checked_mul(self, other: Ratio) -> Option<Ratio> {
        let g1 = gcd(self.num, other.den).max(1);
        let g2 = gcd(other.num, self.den).max(1);
        let num = (self.num / g1).checked_mul(other.num / g2)?;
        let den = (self.den / g2).checked_mul(other.den / g1)?;
        Ratio::new(num, den)
    }

    pub fn checked_add(self, other: Ratio) -> Option<Ratio> {
        let g = gcd(self.den, other.den).max(1);
        let num = (self.num.checked_mul(other.den / g)?)
            .checked_add(other.num.checked_mul(self.den / g)?)?;
        Ratio::new(num, (self.den / g).checked_mul(other.den)?)
    }

    pub fn checked_div(self, other: Ratio) -> Option<Ratio> {
        if other.num == 0 {
            return None;
        }
        self.checked_mul(
            Ratio {
                num: other.den,
                den: other.num,
            }
            .normalised(),
        )
    }

    fn normalised(self) -> Ratio {
        Ratio::new(self.num, self.den).expect("denominator is non-zero")
    }
}

impl fmt::Display for Ratio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.den == 1 {
            write!(f, "{}", self.num)
        } else {
            write!(f, "{}/{}", self.num, self.den)
        }
    }
}

impl fmt::Debug for Ratio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// One dimension of a shape: `coeff * sym_1 * sym_2 * …` (symbols sorted, may repeat).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Dim {
    coeff: Ratio,
    syms: Vec<SymId>,
}

impl Dim {
    pub fn konst(n: i64) -> Dim {
        Dim {
            coeff: Ratio::int(n),
            syms: Vec::new(),
        }
    }

    pub fn sym(s: SymId) -> Dim {
        Dim {
            coeff: Ratio::ONE,
            syms: vec![s],
        }
    }

    pub fn coeff(&self) -> Ratio {
        self.coeff
    }

    pub fn syms(&self) -> &[SymId] {
        &self.syms
    }

    /// The value when the dimension has no symbols and is a whole number.
    pub fn as_const(&self) -> Option<i64> {
        if self.syms.is_empty() {
            self.coeff.as_int()
        } else {
            None
        }
    }

    pub fn is_one(&self) -> bool {
        self.as_const() == Some(1)
    }

    pub fn checked_mul(&self, other: &Dim) -> Option<Dim> {
        let mut syms: Vec<SymId> = self.syms.iter().chain(&other.syms).copied().collect();
        syms.sort();
        Some(Dim {
            coeff: self.coeff.checked_mul(other.coeff)?,
            syms,
        })
    }

    pub fn checked_scale(&self, r: Ratio) -> Option<Dim> {
        Some(Dim {
            coeff: self.coeff.checked_mul(r)?,
            syms: self.syms.clone(),
        })
    }

    /// `self / other` when the symbols of `other` divide those of `self`.
    pub fn checked_div(&self, other: &Dim) -> Option<Dim> {
        let mut syms = self.syms.clone();
        for s in &other.syms {
            let at = syms.iter().position(|x| x == s)?;
            syms.remove(at);
        }
        Some(Dim {
            coeff: self.coeff.checked_div(other.coeff)?,
            syms,
        })
    }

    /// `self + other` when both have the same symbols (or none).
    pub fn checked_add(&self, other: &Dim) -> Option<Dim> {
        (self.syms == other.syms).then_some(())?;
        Some(Dim {
            coeff: self.coeff.checked_add(other.coeff)?,
            syms: self.syms.clone(),
        })
    }

    /// The value under `bind`, rounded up: a concrete run allocates whole elements.
    pub fn eval(&self, bind: &dyn Fn(SymId) -> i64) -> i64 {
        let exact = self.syms.iter().fold(self.coeff, |acc, &s| {
            acc.checked_mul(Ratio::int(bind(s))).unwrap_or(acc)
        });
        (exact.numer() + exact.denom() - 1).div_euclid(exact.denom()) as i64
    }

    /// Print with symbol names looked up in `names`.
    pub fn display<'a>(&'a self, names: &'a [String]) -> impl fmt::Display + 'a {
        DimDisplay { dim: self, names }
    }
}

struct DimDisplay<'a> {
    dim: &'a Dim,
    names: &'a [String],
}

impl fmt::Display for DimDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Dim { coeff, syms } = self.dim;
        if syms.is_empty() {
            return write!(f, "{coeff}");
        }
        if coeff.numer() != 1 {
            write!(f, "{}*", coeff.numer())?;
        }
        for (i, s) in syms.iter().enumerate() {
            if i > 0 {
                f.write_str("*")?;
            }
            match self.names.get(s.index()) {
                Some(name) => f.write_str(name)?,
                None => write!(f, "{s}")?,
            }
        }
        if coeff.denom() != 1 {
            write!(f, "/{}", coeff.denom())?;
        }
        Ok(())
    }
}

/// The dimensions of a tensor, outermost first.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    pub fn scalar() -> Shape {
        Shape(Vec::new())
    }

    pub fn from_consts(dims: &[i64]) -> Shape {
        Shape(dims.iter().map(|&d| Dim::konst(d)).collect())
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn dims(&self) -> &[Dim] {
        &self.0
    }

    pub fn last(&self) -> Option<&Dim> {
        self.0.last()
    }

    /// The number of elements as a monomial.
    pub fn numel(&self) -> Option<Dim> {
        self.0
            .iter()
            .try_fold(Dim::konst(1), |acc, d| acc.checked_mul(d))
    }

    /// Resolve a possibly negative axis (`-1` is the last) against this rank.
    pub fn axis(&self, axis: i64) -> Option<usize> {
        let rank = self.rank() as i64;
        let a = if axis < 0 { axis + rank } else { axis };
        (0..rank).contains(&a).then_some(a as usize)
    }

    pub fn display<'a>(&'a self, names: &'a [String]) -> impl fmt::Display + 'a {
        ShapeDisplay { shape: self, names }
    }
}

struct ShapeDisplay<'a> {
    shape: &'a Shape,
    names: &'a [String],
}

impl fmt::Display for ShapeDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.shape.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}", d.display(self.names))?;
        }
        f.write_str("]")
    }
}

/// A sum of monomials over symbols: how analyses add up elements, FLOPs and bytes.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Poly {
    terms: BTreeMap<Vec<SymId>, Ratio>,
}

impl Poly {
    pub fn zero() -> Poly {
        Poly::default()
    }

    pub fn from_dim(d: &Dim) -> Poly {
        let mut p = Poly::zero();
        p.add_dim(d, Ratio::ONE);
        p
    }

    /// `self += scale * d`.
    pub fn add_dim(&mut self, d: &Dim, scale: Ratio) {
        let c = d
            .coeff()
            .checked_mul(scale)
            .expect("analysis coefficients fit in i128");
        let entry = self.terms.entry(d.syms().to_vec()).or_insert(Ratio::ZERO);
        *entry = entry
            .checked_add(c)
            .expect("analysis coefficients fit in i128");
        if *entry == Ratio::ZERO {
            self.terms.remove(d.syms());
        }
    }

    pub fn add_poly(&mut self, other: &Poly, scale: Ratio) {
        for (syms, c) in &other.terms {
            let d = Dim {
                coeff: *c,
                syms: syms.clone(),
            };
            self.add_dim(&d, scale);
        }
    }

    pub fn terms(&self) -> impl Iterator<Item = (&[SymId], Ratio)> {
        self.terms.iter().map(|(s, c)| (s.as_slice(), *c))
    }

    pub fn is_zero(&self) -> bool {
        self.terms.is_empty()
    }

    /// The value under `bind`, exactly as a float (no rounding of fractional terms).
    pub fn eval(&self, bind: &dyn Fn(SymId) -> f64) -> f64 {
        self.terms
            .iter()
            .map(|(syms, c)| syms.iter().fold(c.to_f64(), |acc, &s| acc * bind(s)))
            .sum()
    }

    pub fn display<'a>(&'a self, names: &'a [String]) -> impl fmt::Display + 'a {
        PolyDisplay { poly: self, names }
    }
}

struct PolyDisplay<'a> {
    poly: &'a Poly,
    names: &'a [String],
}

impl fmt::Display for PolyDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.poly.is_zero() {
            return f.write_str("0");
        }
        // Highest degree first, as a person writes `2*a*s*s + 34*h*s`.
        let mut terms: Vec<_> = self.poly.terms.iter().collect();
        terms.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(b.0)));
        for (i, (syms, c)) in terms.into_iter().enumerate() {
            if i > 0 {
                f.write_str(" + ")?;
            }
            let d = Dim {
                coeff: *c,
                syms: syms.clone(),
            };
            write!(f, "{}", d.display(self.names))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_multiply_and_divide_exactly() {
        let b = Dim::sym(SymId::new(0));
        let s = Dim::sym(SymId::new(1));
        let tokens = b.checked_mul(&s).unwrap();
        let per_expert = tokens.checked_scale(Ratio::new(2, 8).unwrap()).unwrap();
        let names = vec!["batch".to_string(), "seq".to_string()];
        assert_eq!(per_expert.display(&names).to_string(), "batch*seq/4");
        assert_eq!(per_expert.eval(&|_| 3), 3); // 9/4 rounds up
        assert_eq!(tokens.checked_div(&b).unwrap(), s);
        assert!(b.checked_div(&s).is_none());
        assert_eq!(
            Dim::konst(768)
                .checked_div(&Dim::konst(12))
                .unwrap()
                .as_const(),
            Some(64)
        );
        assert_eq!(
            Dim::konst(10)
                .checked_div(&Dim::konst(4))
                .unwrap()
                .as_const(),
            None
        );
    }

    #[test]
    fn polys_collect_like_terms() {
        let s = Dim::sym(SymId::new(0));
        let mut p = Poly::zero();
        p.add_dim(&s, Ratio::int(34));
        p.add_dim(&s.checked_mul(&s).unwrap(), Ratio::int(5));
        p.add_dim(&s, Ratio::int(-4));
        let names = vec!["s".to_string()];
        assert_eq!(p.display(&names).to_string(), "5*s*s + 30*s");
        assert_eq!(p.eval(&|_| 2.0), 80.0);
    }
}
