//! Layout changes on the device: the fused compute's `Op::Relayout` steps
//! (the tensor-, context- and expert-parallel collectives) run on a
//! backend's buffers by [`crate::shard::convert_with`]'s rules, the same
//! that convert the reference's host tensors. Pieces are cut and joined by
//! the backend's strided copies ([`Backend::copy_rows`]: a 2-D copy on a
//! GPU), a group's parts summed by [`sum_parts_kernel`]
//! (from zero, in group order, in `f32`: the reference's bits), and moved
//! between ranks by the store's [`Links`] — NCCL where each rank has a GPU,
//! device to device where ranks share one, else through the host.
//!
//! Before, every layout change downloaded its whole value, converted it on
//! the host and uploaded the result: a gpt2 step at tp=2 crossed the host
//! about 275 times per rank (bench/RESULTS.md, the eighth H200 session).

use super::{flat_args, Backend, Shaped, Val};
use crate::comm::{Communicator, Group};
use crate::error::{kernel_err, Result};
use crate::params::Links;
use crate::shard::Moves;
use dplc_codegen::{sum_parts_kernel, Elem, Kernel};
use std::collections::HashMap;
use std::ops::Range;

/// The kernels of layout changes, built once per store (the GPU backend
/// finds a kernel by its address; see `crate::gpu`'s kernel cache).
pub(crate) struct LayoutKernels {
    /// By element type and number of parts (a group's size).
    sums: HashMap<(Elem, usize), Box<Kernel>>,
}

impl LayoutKernels {
    pub fn new() -> Self {
        LayoutKernels {
            sums: HashMap::new(),
        }
    }

    pub fn sum(&mut self, elem: Elem, parts: usize) -> &Kernel {
        self.sums
            .entry((elem, parts))
            .or_insert_with(|| Box::new(sum_parts_kernel(elem, parts)))
    }
}

/// [`Moves`] on a backend's buffers: the kernels on `be`, the exchanges
/// through `links` (and, where they stage, `comm`).
pub(crate) struct DeviceMoves<'x, B: Backend, L> {
    pub be: &'x mut B,
    pub links: &'x mut L,
    pub comm: &'x mut Communicator,
    pub kernels: &'x mut LayoutKernels,
}

impl<B: Backend, L: Links<B>> DeviceMoves<'_, B, L> {
    fn alloc(&mut self, elem: Elem, dims: Vec<usize>) -> Result<Shaped<B>> {
        let len = dims.iter().product();
        Ok(Shaped {
            val: Val {
                buf: self.be.alloc(elem, len)?,
                elem,
                len,
            },
            dims,
        })
    }

    /// `rows` rows of `width` elements of `src` (stride and first element
    /// `from`) into `dst` (`to`).
    fn copy_rows(
        &mut self,
        src: &Val<B>,
        dst: &Val<B>,
        rows: usize,
        width: usize,
        (from, to): ((usize, usize), (usize, usize)),
    ) -> Result<()> {
        self.be.copy_rows(
            src.elem,
            (&src.buf, from.1, from.0),
            (&dst.buf, to.1, to.0),
            rows,
            width,
        )
    }
}

/// The elements before `axis` and after it.
fn outer_inner(dims: &[usize], axis: usize) -> (usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis + 1..].iter().product(),
    )
}

impl<B: Backend, L: Links<B>> Moves for DeviceMoves<'_, B, L> {
    type V = Shaped<B>;

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn dims<'v>(&self, v: &'v Shaped<B>) -> &'v [usize] {
        &v.dims
    }

    fn cut(&mut self, v: &Shaped<B>, axis: usize, ranges: &[Range<usize>]) -> Result<Shaped<B>> {
        let n = crate::shard::cut_axis(&v.dims, axis, ranges)?;
        let (outer, inner) = outer_inner(&v.dims, axis);
        let taken: usize = ranges.iter().map(|r| r.len()).sum();
        let mut dims = v.dims.clone();
        dims[axis] = taken;
        let out = self.alloc(v.val.elem, dims)?;
        let mut at = 0;
        for r in ranges {
            self.copy_rows(
                &v.val,
                &out.val,
                outer,
                r.len() * inner,
                ((n * inner, r.start * inner), (taken * inner, at * inner)),
            )?;
            at += r.len();
        }
        Ok(out)
    }

    fn join(&mut self, parts: &[Shaped<B>], axis: usize) -> Result<Shaped<B>> {
        let first = parts
            .first()
            .ok_or_else(|| kernel_err("layout", "nothing to join"))?;
        if parts
            .iter()
            .any(|p| p.dims != first.dims || p.val.elem != first.val.elem)
        {
            return Err(kernel_err("layout", "parts of different shapes"));
        }
        let len = first.dims[axis];
        let (outer, inner) = outer_inner(&first.dims, axis);
        let mut dims = first.dims.clone();
        dims[axis] = len * parts.len();
        let out = self.alloc(first.val.elem, dims)?;
        for (p, part) in parts.iter().enumerate() {
            self.copy_rows(
                &part.val,
                &out.val,
                outer,
                len * inner,
                (
                    (len * inner, 0),
                    (parts.len() * len * inner, p * len * inner),
                ),
            )?;
        }
        Ok(out)
    }

    fn zeros(&mut self, like: &Shaped<B>, dims: &[usize]) -> Result<Shaped<B>> {
        let len = dims.iter().product();
        Ok(Shaped {
            val: Val {
                buf: self.be.zeros(like.val.elem, len)?,
                elem: like.val.elem,
                len,
            },
            dims: dims.to_vec(),
        })
    }

    fn sum(&mut self, parts: &[Shaped<B>]) -> Result<Shaped<B>> {
        let first = parts
            .first()
            .ok_or_else(|| kernel_err("layout", "nothing to sum"))?;
        if parts
            .iter()
            .any(|p| p.val.len != first.val.len || p.val.elem != first.val.elem)
        {
            return Err(kernel_err("layout", "parts of different sizes"));
        }
        let out = self.alloc(first.val.elem, first.dims.clone())?;
        if out.val.len > 0 {
            let mut bufs = vec![out.val.buf.clone()];
            bufs.extend(parts.iter().map(|p| p.val.buf.clone()));
            let kernel = self.kernels.sum(first.val.elem, parts.len());
            self.be.launch(kernel, &flat_args(out.val.len), &bufs)?;
        }
        Ok(out)
    }

    fn all_gather(&mut self, group: &Group, v: &Shaped<B>) -> Result<Vec<Shaped<B>>> {
        match self.links.gather_value(self.be, self.comm, group, &v.val)? {
            Some(all) => Ok(all
                .into_iter()
                .map(|val| Shaped {
                    val,
                    dims: v.dims.clone(),
                })
                .collect()),
            None => self.all_to_all(group, vec![v.clone(); group.size()]),
        }
    }

    fn all_reduce(&mut self, group: &Group, v: &Shaped<B>) -> Result<Shaped<B>> {
        match self.links.sum_value(self.be, self.comm, group, &v.val)? {
            Some(val) => Ok(Shaped {
                val,
                dims: v.dims.clone(),
            }),
            None => {
                let all = self.all_gather(group, v)?;
                self.sum(&all)
            }
        }
    }

    fn reduce_scatter(&mut self, group: &Group, pieces: Vec<Shaped<B>>) -> Result<Shaped<B>> {
        let pos = crate::params::all_to_all_position(self.comm, group, &pieces)?;
        let vals: Vec<Val<B>> = pieces.iter().map(|p| p.val.clone()).collect();
        match self.links.scatter_sum(self.be, self.comm, group, &vals)? {
            Some(val) => Ok(Shaped {
                val,
                dims: pieces[pos].dims.clone(),
            }),
            None => {
                let got = self.all_to_all(group, pieces)?;
                self.sum(&got)
            }
        }
    }

    fn all_to_all(&mut self, group: &Group, pieces: Vec<Shaped<B>>) -> Result<Vec<Shaped<B>>> {
        // Every member cuts the same shapes: what arrives has this rank's.
        let pos = group.position(self.comm.rank()).unwrap_or(0);
        let dims = pieces
            .get(pos)
            .map(|p| p.dims.clone())
            .ok_or_else(|| kernel_err("layout", "no piece for this rank"))?;
        let vals = pieces.into_iter().map(|p| p.val).collect();
        let got = self.links.all_to_all(self.be, self.comm, group, vals)?;
        Ok(got
            .into_iter()
            .map(|val| Shaped {
                val,
                dims: dims.clone(),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::World;
    use crate::fused::HostBackend;
    use crate::params::HostStaged;
    use crate::shard::{convert, convert_with, MeshGroups};
    use crate::tensor::Tensor;
    use dplc_ir::DType;
    use dplc_ir::TensorLayout::{self, Context, Experts, Partial, Replicated, Split};
    use std::time::Duration;

    /// Every conversion the reference makes, on a backend's buffers through
    /// host-staged links, gives the host's bits on every rank of a group of
    /// `n`: whole, split and partial values, context chunks and experts.
    fn matches_the_host(n: usize, storage: DType) {
        let cases: Vec<(TensorLayout, TensorLayout, Vec<usize>)> = vec![
            (Partial, Replicated, vec![3, 4, 6]),
            (Partial, Split { axis: 2 }, vec![3, 4, 6 * n]),
            (Partial, Split { axis: 0 }, vec![2 * n, 5]),
            (Split { axis: 1 }, Replicated, vec![3, 2, 5]),
            (Split { axis: 2 }, Replicated, vec![2, 3, 4]),
            (Replicated, Split { axis: 1 }, vec![3, 2 * n, 5]),
            (Split { axis: 0 }, Split { axis: 1 }, vec![2, 2 * n]),
            (Context { axis: 1 }, Replicated, vec![2, 4, 3]),
            (Replicated, Context { axis: 1 }, vec![2, 4 * n, 3]),
            (Partial, Context { axis: 1 }, vec![2, 4 * n, 3]),
            (Context { axis: 1 }, Partial, vec![2, 4, 3]),
            (Replicated, Experts, vec![2 * n, 3, 4]),
            (Experts, Replicated, vec![4, 3 * n, 2]),
        ];
        let world = World::new(n, Duration::from_secs(10));
        std::thread::scope(|s| {
            let ranks: Vec<_> = (0..n)
                .map(|r| {
                    let mut comm = world.communicator(r);
                    let cases = &cases;
                    s.spawn(move || {
                        let all = crate::comm::Group::new((0..n).collect());
                        let groups = MeshGroups {
                            tp: all.clone(),
                            ep: all.clone(),
                            cp: all,
                            skip_partial_sum: false,
                        };
                        let mut be = HostBackend::with_storage(storage);
                        let mut links = HostStaged;
                        let mut kernels = LayoutKernels::new();
                        for (from, to, dims) in cases {
                            let len: usize = dims.iter().product();
                            // Values the storage type holds exactly, so the
                            // host's tensor is what the buffer holds.
                            let x: Vec<f32> = (0..len)
                                .map(|i| ((i * 7 + r * 13) % 23) as f32 * 0.125 - 1.0)
                                .collect();
                            let t = Tensor::f32(dims.clone(), x.clone());
                            let want = convert(&mut comm, &groups, &t, *from, *to).unwrap();
                            let v = Shaped {
                                val: Val {
                                    buf: be.upload(Elem::Float, &x).unwrap(),
                                    elem: Elem::Float,
                                    len,
                                },
                                dims: dims.clone(),
                            };
                            let mut moves = DeviceMoves {
                                be: &mut be,
                                links: &mut links,
                                comm: &mut comm,
                                kernels: &mut kernels,
                            };
                            let got = convert_with(&mut moves, &groups, &v, *from, *to).unwrap();
                            assert_eq!(got.dims, want.shape, "{from:?} → {to:?} on rank {r}");
                            let got = be.download(&got.val.buf, Elem::Float, got.val.len).unwrap();
                            let want = want.f().unwrap();
                            let stored: Vec<f32> = want
                                .iter()
                                .map(|&w| {
                                    let b = be.upload(Elem::Float, &[w]).unwrap();
                                    be.download(&b, Elem::Float, 1).unwrap()[0]
                                })
                                .collect();
                            assert_eq!(got, stored, "{from:?} → {to:?} on rank {r}");
                        }
                    })
                })
                .collect();
            for h in ranks {
                h.join().expect("a rank");
            }
        });
    }

    #[test]
    fn every_layout_change_on_the_device_has_the_hosts_bits() {
        matches_the_host(2, DType::F32);
        matches_the_host(3, DType::BF16);
        matches_the_host(4, DType::F32);
    }
}
