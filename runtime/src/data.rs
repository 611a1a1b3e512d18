//! Training data: a token stream (synthetic from the seed, raw bytes, or a flat
//! u16 token file) cut into samples of `seq + 1` tokens, each a pure function of
//! its global sample index so that any split of the batch sees the same data.

use crate::error::{Result, RuntimeError};
use crate::rng;
use std::path::Path;

/// A stream of token ids.
#[derive(Clone, Debug, PartialEq)]
pub struct Corpus {
    tokens: Vec<i32>,
    seed: u64,
}

/// How a data file stores its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenFormat {
    /// Every byte is a token (vocab 256).
    Bytes,
    /// Little-endian `u16` token ids, back to back.
    U16,
}

impl Corpus {
    /// `len` tokens from a first-order Markov chain drawn from `seed`: each
    /// token has four likely successors (60/25/10/5 %), so a model can learn
    /// it and the loss falls from ln(vocab) towards about 1.1 nats.
    pub fn synthetic(seed: u64, vocab: usize, len: usize) -> Corpus {
        let vocab = vocab.max(1);
        let next = |tok: usize, j: u64| {
            (rng::hash(&[seed, 0x5EED, tok as u64, j]) % vocab as u64) as usize
        };
        let mut tokens = Vec::with_capacity(len);
        let mut cur = 0usize;
        for i in 0..len {
            tokens.push(cur as i32);
            let u = rng::uniform(&[seed, 0xDA7A, i as u64]);
            let j = match u {
                u if u < 0.60 => 0,
                u if u < 0.85 => 1,
                u if u < 0.95 => 2,
                _ => 3,
            };
            cur = next(cur, j);
        }
        Corpus { tokens, seed }
    }

    pub fn from_tokens(tokens: Vec<i32>, seed: u64) -> Corpus {
        Corpus { tokens, seed }
    }

    /// Read a token file.
    pub fn from_file(path: &Path, format: TokenFormat, seed: u64) -> Result<Corpus> {
        let bytes = std::fs::read(path)
            .map_err(|e| RuntimeError::Data(format!("cannot read {}: {e}", path.display())))?;
        let tokens = match format {
            TokenFormat::Bytes => bytes.iter().map(|&b| i32::from(b)).collect(),
            TokenFormat::U16 => {
                if bytes.len() % 2 != 0 {
                    return Err(RuntimeError::Data(format!(
                        "{} has {} bytes, not a whole number of u16 tokens",
                        path.display(),
                        bytes.len()
                    )));
                }
                bytes
                    .chunks_exact(2)
                    .map(|c| i32::from(u16::from_le_bytes([c[0], c[1]])))
                    .collect()
            }
        };
        Ok(Corpus { tokens, seed })
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Check that samples of `seq` tokens fit and every id is below `vocab`.
    pub fn check(&self, seq: usize, vocab: Option<usize>) -> Result<()> {
        if self.tokens.len() < seq + 1 {
            return Err(RuntimeError::Data(format!(
                "the data has {} tokens but one sample needs seq + 1 = {}",
                self.tokens.len(),
                seq + 1
            )));
        }
        if let (Some(v), Some(&max)) = (vocab, self.tokens.iter().max()) {
            if max as usize >= v {
                return Err(RuntimeError::Data(format!(
                    "token id {max} is outside the model's vocabulary of {v}"
                )));
            }
        }
        Ok(())
    }

    /// Inputs and next-token targets of global sample `index`: a window at a
    /// position hashed from the seed and the index.
    pub fn sample(&self, index: u64, seq: usize) -> (Vec<i32>, Vec<i32>) {
        let starts = (self.tokens.len() - seq) as u64;
        let at = (rng::hash(&[self.seed, 0x5A3F, index]) % starts) as usize;
        let window = &self.tokens[at..at + seq + 1];
        (window[..seq].to_vec(), window[1..].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_shifted_by_one_and_reproducible() {
        let c = Corpus::synthetic(3, 256, 4096);
        let (x, y) = c.sample(17, 16);
        assert_eq!(x[1..], y[..15]);
        assert_eq!(
            c.sample(17, 16),
            Corpus::synthetic(3, 256, 4096).sample(17, 16)
        );
        assert!(c.check(16, Some(256)).is_ok());
    }

    #[test]
    fn a_short_file_is_a_clear_error() {
        let path = std::env::temp_dir().join(format!("dplc-short-{}.txt", std::process::id()));
        std::fs::write(&path, b"hello").unwrap();
        let c = Corpus::from_file(&path, TokenFormat::Bytes, 0).unwrap();
        std::fs::remove_file(&path).ok();
        assert_eq!(
            c.check(64, Some(256)).unwrap_err().to_string(),
            "data: the data has 5 tokens but one sample needs seq + 1 = 65"
        );
    }
}
