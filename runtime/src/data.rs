//! Training data: a token stream (synthetic from the seed, raw bytes, or a flat
//! u16 token file) cut into samples of `seq + 1` tokens, and per-input arrays
//! (NumPy `.npy` or safetensors, axis 0 indexing the samples) or synthetic
//! values for every other input. Each sample is a pure function of its global
//! sample index, so that any split of the batch sees the same data.

use crate::error::{Result, RuntimeError};
use crate::rng;
use crate::tensor::Data;
use std::collections::BTreeMap;
use std::path::Path;

/// A stream of token ids, and the samples of inputs read from arrays.
#[derive(Clone, Debug, PartialEq)]
pub struct Corpus {
    tokens: Vec<i32>,
    /// The token file the stream was read from (none: synthetic).
    file: Option<std::path::PathBuf>,
    seed: u64,
    arrays: BTreeMap<String, Samples>,
}

/// One input's samples from a file: `count` samples of `shape` each.
#[derive(Clone, Debug, PartialEq)]
struct Samples {
    shape: Vec<usize>,
    count: usize,
    data: Data,
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
        Corpus::from_tokens(tokens, seed)
    }

    pub fn from_tokens(tokens: Vec<i32>, seed: u64) -> Corpus {
        Corpus {
            tokens,
            file: None,
            seed,
            arrays: BTreeMap::new(),
        }
    }

    /// Read a token file.
    pub fn from_file(path: &Path, format: TokenFormat, seed: u64) -> Result<Corpus> {
        let bytes = read(path)?;
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
        Ok(Corpus {
            file: Some(path.to_path_buf()),
            ..Corpus::from_tokens(tokens, seed)
        })
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

    /// Feed input `name` from a NumPy `.npy` file: its axis 0 indexes the
    /// samples, the rest is one sample's shape. Floats (`f4`, `f8`) and
    /// integers (`i1`…`i8`, `u1`, `u2`) in little-endian C order.
    pub fn add_npy(&mut self, name: &str, path: &Path) -> Result<()> {
        let bytes = read(path)?;
        let (shape, data) = npy(&bytes).map_err(|e| data_err(path, e))?;
        self.add(name, shape, data).map_err(|e| data_err(path, e))
    }

    /// Feed every input named like a tensor of a safetensors file from it
    /// (axis 0 indexes the samples).
    pub fn add_safetensors(&mut self, path: &Path) -> Result<()> {
        let bytes = read(path)?;
        let file = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| data_err(path, format!("not a safetensors file: {e}")))?;
        for (name, view) in file.tensors() {
            let data = from_le(&dtype_name(view.dtype()), view.data())
                .map_err(|e| data_err(path, format!("tensor `{name}`: {e}")))?;
            self.add(&name, view.shape().to_vec(), data)
                .map_err(|e| data_err(path, format!("tensor `{name}`: {e}")))?;
        }
        Ok(())
    }

    fn add(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        data: Data,
    ) -> std::result::Result<(), String> {
        let Some((&count, rest)) = shape.split_first() else {
            return Err("a scalar holds no samples: axis 0 must index them".into());
        };
        if count == 0 {
            return Err("no samples (axis 0 is empty)".into());
        }
        if self.arrays.contains_key(name) {
            return Err(format!(
                "input `{name}` is already fed by an earlier --data; give each input one file"
            ));
        }
        self.arrays.insert(
            name.to_string(),
            Samples {
                shape: rest.to_vec(),
                count,
                data,
            },
        );
        Ok(())
    }

    /// Whether input `name` is read from an array.
    pub fn has_array(&self, name: &str) -> bool {
        self.arrays.contains_key(name)
    }

    /// Check that input `name` can be fed samples of `shape`: from its array
    /// (the same per-sample shape, integers for an integer input, every id
    /// below `bound`), or drawn (an integer input needs a `bound`).
    pub fn check_input(
        &self,
        name: &str,
        int: bool,
        shape: &[usize],
        bound: Option<u64>,
    ) -> Result<()> {
        let Some(a) = self.arrays.get(name) else {
            if int && bound.is_none() {
                return Err(RuntimeError::Data(format!(
                    "integer input `{name}`: nothing in the model indexes with it, so its values cannot be drawn; give its data with --data {name}=FILE.npy"
                )));
            }
            return Ok(());
        };
        if a.shape != shape {
            return Err(RuntimeError::Data(format!(
                "input `{name}`: the model takes samples of shape {shape:?}, its data has {:?}",
                a.shape
            )));
        }
        match (&a.data, int) {
            (Data::I32(v), true) => {
                let bad = v
                    .iter()
                    .find(|&&i| i < 0 || bound.is_some_and(|b| i as u64 >= b));
                if let Some(i) = bad {
                    return Err(RuntimeError::Data(format!(
                        "input `{name}`: id {i} is outside [0, {})",
                        bound.map_or("2^31".to_string(), |b| b.to_string())
                    )));
                }
                Ok(())
            }
            (Data::F32(_), false) => Ok(()),
            (Data::I32(_), false) => Ok(()),
            (Data::F32(_), true) => Err(RuntimeError::Data(format!(
                "input `{name}` takes integer ids; its data holds floats"
            ))),
        }
    }

    /// Global sample `index` of input `name` (checked by [`Corpus::check_input`]):
    /// sample `index mod count` of its array, or a draw keyed by the seed,
    /// the input and the index — normal floats, ids uniform below `bound`.
    pub fn input_sample(
        &self,
        name: &str,
        int: bool,
        numel: usize,
        bound: Option<u64>,
        index: u64,
    ) -> Data {
        if let Some(a) = self.arrays.get(name) {
            let at = (index % a.count as u64) as usize * numel;
            return match (&a.data, int) {
                (Data::I32(v), true) => Data::I32(v[at..at + numel].to_vec()),
                (Data::I32(v), false) => {
                    Data::F32(v[at..at + numel].iter().map(|&x| x as f32).collect())
                }
                (Data::F32(v), _) => Data::F32(v[at..at + numel].to_vec()),
            };
        }
        let key = rng::hash(&[self.seed, 0x1A7A, name_key(name)]);
        if int {
            let b = bound.unwrap_or(1).max(1);
            Data::I32(
                (0..numel as u64)
                    .map(|j| (rng::hash(&[key, index, j]) % b) as i32)
                    .collect(),
            )
        } else {
            Data::F32(
                (0..numel as u64)
                    .map(|j| rng::normal(&[key, index, j]) as f32)
                    .collect(),
            )
        }
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

/// What feeds one model input.
#[derive(Debug)]
pub(crate) enum Feed {
    /// `tokens`: `seq`-token windows of the corpus's stream.
    Tokens,
    /// `targets`: the same windows shifted by one token.
    Targets,
    /// Per-sample values of `shape` (after the batch axis): the input's array
    /// in the corpus, else drawn from the seed (ids below `bound`).
    Samples {
        name: String,
        int: bool,
        shape: Vec<usize>,
        bound: Option<u64>,
    },
}

impl Feed {
    pub(crate) fn is_stream(&self) -> bool {
        matches!(self, Feed::Tokens | Feed::Targets)
    }
}

/// How each input of `graph` is fed, checked against `data`: `tokens` and
/// `targets` of shape `[batch, seq]` from the stream unless an array names
/// them, every other input per sample. An input's first axis must be `batch`.
pub(crate) fn feeds(
    graph: &dplc_ir::Graph,
    data: &Corpus,
    syms: &[i64],
) -> Result<Vec<(dplc_ir::TensorId, Feed)>> {
    let batch = graph.sym_by_name("batch");
    let seq = graph.sym_by_name("seq");
    let mut out = Vec::new();
    // How many of `tokens` and `targets` the stream could feed.
    let mut stream_inputs = 0;
    for (_, input) in graph.inputs() {
        let dims = input.shape.dims();
        let is = |d: &dplc_ir::Dim, s: Option<dplc_ir::SymId>| {
            s.is_some_and(|s| *d == dplc_ir::Dim::sym(s))
        };
        if dims.first().is_none_or(|d| !is(d, batch)) {
            return Err(RuntimeError::Unsupported(format!(
                "input `{}`: the data loader batches along the first axis, which must be `batch` (it is {})",
                input.name,
                graph.dim_str(&input.shape.dims()[..].first().cloned().unwrap_or(dplc_ir::Dim::konst(1)))
            )));
        }
        let int = !input.dtype.is_float();
        let stream_shaped = int && dims.len() == 2 && is(&dims[1], seq);
        if stream_shaped && matches!(input.name.as_str(), "tokens" | "targets") {
            stream_inputs += 1;
        }
        let lm = stream_shaped && !data.has_array(&input.name);
        let feed = match input.name.as_str() {
            "tokens" if lm => Feed::Tokens,
            "targets" if lm => Feed::Targets,
            name => {
                let shape: Vec<usize> = dims[1..]
                    .iter()
                    .map(|d| d.eval(&|s| syms[s.index()]).max(0) as usize)
                    .collect();
                let bound = graph.index_bound(input.tensor);
                data.check_input(name, int, &shape, bound)?;
                Feed::Samples {
                    name: name.to_string(),
                    int,
                    shape,
                    bound,
                }
            }
        };
        out.push((input.tensor, feed));
    }
    check_every_file_feeds(graph, data, &out, stream_inputs)?;
    Ok(out)
}

/// Data the user gave that would feed nothing is refused, not ignored: an
/// array named after no input (a misspelt `--data NAME=…`, a safetensors
/// file of other tensors) or a token file when arrays feed both `tokens`
/// and `targets`; and where the stream could feed both (`stream_inputs`:
/// both are `[batch, seq]` ids), they come from one source, never one from
/// an array and the other from the stream.
fn check_every_file_feeds(
    graph: &dplc_ir::Graph,
    data: &Corpus,
    feeds: &[(dplc_ir::TensorId, Feed)],
    stream_inputs: usize,
) -> Result<()> {
    let inputs: Vec<&str> = graph.inputs().map(|(_, i)| i.name.as_str()).collect();
    let list = inputs.join(", ");
    for name in data.arrays.keys() {
        if !inputs.contains(&name.as_str()) {
            return Err(RuntimeError::Data(format!(
                "the data holds `{name}`, which is no input of the model (its inputs: {list}); \
                 name each array after the input it feeds"
            )));
        }
    }
    let stream = feeds.iter().filter(|(_, f)| f.is_stream()).count();
    if stream_inputs == 2 && stream == 1 {
        return Err(RuntimeError::Data(
            "`tokens` and `targets` are one stream: give both as arrays, or neither (a token file or the synthetic corpus feeds them)".into(),
        ));
    }
    if let (Some(file), 0) = (&data.file, stream) {
        return Err(RuntimeError::Data(format!(
            "the token file {} feeds nothing: arrays feed every input; drop it or the arrays",
            file.display()
        )));
    }
    Ok(())
}

/// A data file's bytes. Only a regular file is read: its size is known, so
/// a device (`/dev/zero`) or a FIFO cannot feed the run without end.
fn read(path: &Path) -> Result<Vec<u8>> {
    let cannot =
        |e: std::io::Error| RuntimeError::Data(format!("cannot read {}: {e}", path.display()));
    if !std::fs::metadata(path).map_err(cannot)?.is_file() {
        return Err(RuntimeError::Data(format!(
            "{} is not a regular file; give the data as a file",
            path.display()
        )));
    }
    std::fs::read(path).map_err(cannot)
}

fn data_err(path: &Path, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Data(format!("{}: {e}", path.display()))
}

/// A stable key of an input's name (FNV-1a), so draws do not depend on
/// the order inputs are declared in.
fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// NumPy's spelling of a safetensors element type.
fn dtype_name(d: safetensors::Dtype) -> String {
    use safetensors::Dtype::*;
    match d {
        F32 => "f4",
        F64 => "f8",
        I8 => "i1",
        I16 => "i2",
        I32 => "i4",
        I64 => "i8",
        U8 => "u1",
        U16 => "u2",
        other => return format!("{other:?}"),
    }
    .to_string()
}

/// Little-endian elements of NumPy type `descr` (`f4`, `i8`, …) as f32 or i32.
fn from_le(descr: &str, b: &[u8]) -> std::result::Result<Data, String> {
    fn ints(b: &[u8], w: usize, f: impl Fn(&[u8]) -> i64) -> std::result::Result<Data, String> {
        b.chunks_exact(w)
            .map(|c| i32::try_from(f(c)).map_err(|_| format!("integer {} does not fit i32", f(c))))
            .collect::<std::result::Result<_, _>>()
            .map(Data::I32)
    }
    let w = match descr {
        "f4" | "i4" => 4,
        "f8" | "i8" => 8,
        "i2" | "u2" => 2,
        "i1" | "u1" | "b1" => 1,
        other => {
            return Err(format!(
                "element type `{other}` is not read (f4, f8, i1–i8, u1, u2 are)"
            ))
        }
    };
    if !b.len().is_multiple_of(w) {
        return Err(format!("{} bytes are not whole {w}-byte elements", b.len()));
    }
    let arr = |c: &[u8]| -> [u8; 8] {
        let mut a = [0u8; 8];
        a[..c.len()].copy_from_slice(c);
        a
    };
    match descr {
        "f4" => Ok(Data::F32(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )),
        "f8" => Ok(Data::F32(
            b.chunks_exact(8)
                .map(|c| f64::from_le_bytes(arr(c)) as f32)
                .collect(),
        )),
        "i8" => ints(b, 8, |c| i64::from_le_bytes(arr(c))),
        "i4" => ints(b, 4, |c| {
            i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        }),
        "i2" => ints(b, 2, |c| i64::from(i16::from_le_bytes([c[0], c[1]]))),
        "u2" => ints(b, 2, |c| i64::from(u16::from_le_bytes([c[0], c[1]]))),
        "i1" => ints(b, 1, |c| i64::from(c[0] as i8)),
        _ => ints(b, 1, |c| i64::from(c[0])),
    }
}

/// The shape and elements of a `.npy` file (format versions 1–3).
fn npy(bytes: &[u8]) -> std::result::Result<(Vec<usize>, Data), String> {
    const MAGIC: &[u8] = b"\x93NUMPY";
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err("not a NumPy .npy file (no \\x93NUMPY magic)".into());
    }
    let (len, at) = match bytes[6] {
        1 => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(format!("NumPy format version {v} is not read")),
    };
    let header = bytes
        .get(at..at + len)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or("the header is cut short or not text")?;
    let field = |key: &str| -> std::result::Result<&str, String> {
        let k = header
            .find(&format!("'{key}'"))
            .ok_or(format!("the header has no '{key}'"))?;
        let rest = header[k + key.len() + 2..].trim_start();
        Ok(rest.strip_prefix(':').unwrap_or(rest).trim_start())
    };
    let descr = field("descr")?;
    let descr = descr
        .strip_prefix('\'')
        .and_then(|d| d.split('\'').next())
        .ok_or("'descr' is not a string")?;
    let (order, ty) = descr.split_at(1.min(descr.len()));
    if order == ">" {
        return Err(format!(
            "big-endian `{descr}` is not read; save little-endian"
        ));
    }
    if field("fortran_order")?.starts_with("True") {
        return Err("a Fortran-ordered array is not read; save it in C order".into());
    }
    let shape = field("shape")?;
    let shape = shape
        .strip_prefix('(')
        .and_then(|s| s.split(')').next())
        .ok_or("'shape' is not a tuple")?;
    let shape: Vec<usize> = shape
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| {
            d.parse()
                .map_err(|_| format!("shape entry `{d}` is not a size"))
        })
        .collect::<std::result::Result<_, _>>()?;
    // A header can claim any shape: its element count is checked, not
    // wrapped, before it is compared with what the file holds.
    let n = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or(format!(
            "the shape {shape:?} has more elements than memory can address"
        ))?;
    let data = from_le(ty, &bytes[at + len..])?;
    let got = match &data {
        Data::F32(v) => v.len(),
        Data::I32(v) => v.len(),
    };
    if got != n {
        return Err(format!(
            "the shape {shape:?} needs {n} elements, the file holds {got}"
        ));
    }
    Ok((shape, data))
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

    /// An `.npy` file (version 1.0) with `header`'s dict and `data` after it.
    fn npy_file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut h = header.to_string();
        while !(10 + h.len() + 1).is_multiple_of(64) {
            h.push(' ');
        }
        h.push('\n');
        let mut f = b"\x93NUMPY\x01\x00".to_vec();
        f.extend_from_slice(&(h.len() as u16).to_le_bytes());
        f.extend_from_slice(h.as_bytes());
        f.extend_from_slice(data);
        f
    }

    /// A header whose shape's product wraps around to the element count the
    /// file holds is refused, not read as 2^58 samples.
    #[test]
    fn a_shape_that_overflows_is_refused() {
        let data = vec![0u8; 6400 * 4];
        let ok = npy_file(
            "{'descr': '<i4', 'fortran_order': False, 'shape': (100, 64), }",
            &data,
        );
        assert_eq!(npy(&ok).unwrap().0, vec![100, 64]);
        let huge = (1usize << 58) + 100;
        let wrap = npy_file(
            &format!("{{'descr': '<i4', 'fortran_order': False, 'shape': ({huge}, 64), }}"),
            &data,
        );
        let err = npy(&wrap).unwrap_err();
        assert!(
            err.contains("more elements than memory can address"),
            "{err}"
        );
    }
}
