//! Which layers each pipeline stage holds: the split of the model's
//! layers (of every stack) over the stages, balanced by the time each
//! layer costs; a stage's share of each stack under interleaving; and the
//! micro-batches a stage holds in flight under each schedule.

use crate::cost::{Config, CostModel, Parts};
use crate::profile::StackShare;
use dplc_ir::PipelineSchedule;
use std::ops::Range;

impl CostModel<'_> {
    /// Layers per pipeline stage, balanced by time: the first stage also runs
    /// the embedding and the last the head and loss; a layer costs what a
    /// layer of its stack costs, and a stack's first layer brings its lead-in.
    /// Interleaved, the split is one whose chunks Megatron-LM's interleaving
    /// builds: the even one, or one counting the embedding and/or the loss
    /// as a layer (`dplc_ir::accounted_stage_layers`), whichever has the
    /// fastest slowest stage (a stage's time is that of all its chunks);
    /// several stacks interleave evenly.
    pub fn partition(&mut self, c: &Config) -> Vec<u64> {
        let parts = self.parts(c);
        let (l, p) = (self.profile.layers, c.pp);
        let mut counts = dplc_ir::even_split(l, p);
        let interleaved = c.schedule == PipelineSchedule::Interleaved;
        let stacks = self.profile.stacks.len();
        if p == 1 || c.even_stages || (interleaved && stacks > 1) {
            return counts;
        }
        // FP8's bf16 end layers weigh on the first and the last stage.
        let ends = [
            self.bf16_ends(c, &counts, 0).total(),
            self.bf16_ends(c, &counts, p as usize - 1).total(),
        ];
        let extra = |i: usize| {
            (if i == 0 {
                parts.pre.total() + ends[0]
            } else {
                0.0
            }) + (if i as u64 == p - 1 {
                parts.post.total() + ends[1]
            } else {
                0.0
            })
        };
        if stacks > 1 {
            return self.balance_stacks(&parts, p, extra);
        }
        // One stack: every layer costs the same, and moving a layer from the
        // slowest stage to the fastest is exact.
        let layer = parts.stacks[0].0.total();
        let time = |counts: &[u64], i: usize| counts[i] as f64 * layer + extra(i);
        if interleaved {
            let v = c.virtual_stages.max(1);
            let slowest =
                |counts: &[u64]| (0..p as usize).map(|i| time(counts, i)).fold(0.0, f64::max);
            return [(true, false), (false, true), (true, true)]
                .into_iter()
                .filter_map(|(embedding, loss)| {
                    dplc_ir::accounted_stage_layers(l, p, v, embedding, loss)
                })
                .fold(counts, |best, split| {
                    if slowest(&split) < slowest(&best) {
                        split
                    } else {
                        best
                    }
                });
        }
        for _ in 0..l {
            let (mut hi, mut lo) = (0, 0);
            for i in 0..p as usize {
                if time(&counts, i) > time(&counts, hi) {
                    hi = i;
                }
                if time(&counts, i) < time(&counts, lo) {
                    lo = i;
                }
            }
            if counts[hi] <= 1 {
                break;
            }
            let old = time(&counts, hi);
            counts[hi] -= 1;
            counts[lo] += 1;
            if time(&counts, lo) >= old {
                counts[hi] += 1;
                counts[lo] -= 1;
                break;
            }
        }
        counts
    }

    /// Layers per stage for layers of different costs (several stacks):
    /// the contiguous split whose slowest stage is fastest, found by
    /// bisecting on that stage's time, each stage from the last taking as
    /// many layers as fit — so the early stages, which hold the most
    /// micro-batches in flight under 1F1B, hold the fewest layers.
    fn balance_stacks(&self, parts: &Parts, p: u64, extra: impl Fn(usize) -> f64) -> Vec<u64> {
        let prof = self.profile;
        // Time of the layers before each layer, a stack's lead-in with its first.
        let mut before = vec![0.0];
        for (st, (layer, lead_in)) in prof.stacks.iter().zip(&parts.stacks) {
            for j in 0..st.layers {
                let lead = if j == 0 { lead_in.total() } else { 0.0 };
                before.push(before[before.len() - 1] + lead + layer.total());
            }
        }
        let (l, p) = (prof.layers as usize, p as usize);
        // The stages filled from the last, each with as many layers as keep
        // it within `limit` while leaving one for each earlier stage.
        let fill = |limit: f64| -> Option<Vec<u64>> {
            let mut counts = vec![0u64; p];
            let mut end = l;
            for i in (0..p).rev() {
                let min_start = if i == 0 { 0 } else { i };
                let mut start = end.checked_sub(1)?;
                if before[end] - before[start] + extra(i) > limit {
                    return None;
                }
                while start > min_start && before[end] - before[start - 1] + extra(i) <= limit {
                    start -= 1;
                }
                if i == 0 && start > 0 {
                    return None;
                }
                counts[i] = (end - start) as u64;
                end = start;
            }
            Some(counts)
        };
        let mut hi = before[l] + extra(0) + extra(p - 1);
        let mut lo = 0.0;
        for _ in 0..64 {
            let mid = 0.5 * (lo + hi);
            if fill(mid).is_some() {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        fill(hi).unwrap_or_else(|| dplc_ir::even_split(l as u64, p as u64))
    }

    /// The layers stage `i` runs, by stack (under interleaving, those of
    /// all its chunks) when the stages hold `counts` layers.
    pub fn stage_shares(&self, c: &Config, counts: &[u64], i: usize) -> Vec<StackShare> {
        let prof = self.profile;
        if prof.stacks.len() == 1 {
            return vec![StackShare {
                stack: 0,
                layers: counts[i],
                first: i == 0,
            }];
        }
        let mut out = Vec::new();
        for r in stage_ranges(c, counts, i) {
            merge(&mut out, prof.shares(r));
        }
        out
    }

    /// Stage `i`'s layers split by what partial recomputation does with
    /// them: `(recomputed, kept)`, the first `c.recompute_layers` of each
    /// chunk's run of a stack and the rest ([`dplc_ir::LayerRecompute`]).
    /// Without partial recomputation every layer is in the first list.
    pub fn recompute_split(
        &self,
        c: &Config,
        counts: &[u64],
        i: usize,
    ) -> (Vec<StackShare>, Vec<StackShare>) {
        let policy = c.layer_recompute();
        if !policy.is_partial() {
            return (self.stage_shares(c, counts, i), Vec::new());
        }
        if self.profile.stacks.len() == 1 {
            // One stack: the stage's chunks are an even split of its layers
            // (as `dplc_ir::virtual_stage_layers` cuts them), `n/v` or one
            // more; the search asks this of every configuration it tries,
            // so without building the model's ranges.
            let (n, v) = (counts[i], chunks(c));
            let (base, longer) = (n / v, n % v);
            let rerun =
                longer * policy.recomputed(base + 1) + (v - longer) * policy.recomputed(base);
            let share = |layers, first| StackShare {
                stack: 0,
                layers,
                first,
            };
            let kept = (n > rerun).then(|| share(n - rerun, false));
            return (vec![share(rerun, i == 0)], kept.into_iter().collect());
        }
        let (mut rerun, mut kept) = (Vec::new(), Vec::new());
        for r in stage_ranges(c, counts, i) {
            for sh in self.profile.shares(r) {
                let n = policy.recomputed(sh.layers);
                merge(&mut rerun, [StackShare { layers: n, ..sh }]);
                if sh.layers > n {
                    merge(
                        &mut kept,
                        [StackShare {
                            layers: sh.layers - n,
                            first: false,
                            ..sh
                        }],
                    );
                }
            }
        }
        (rerun, kept)
    }

    /// Per stack, the layers of the whole model that rerun their forward
    /// under full recomputation (all of them unless it is partial).
    pub fn recomputed_layers(&self, c: &Config, counts: &[u64]) -> Vec<u64> {
        let mut out = vec![0; self.profile.stacks.len()];
        for i in 0..counts.len() {
            for sh in self.recompute_split(c, counts, i).0 {
                out[sh.stack] += sh.layers;
            }
        }
        out
    }

    /// Micro-batches (of whole stages) whose activations stage `i` holds at its peak.
    pub fn in_flight(c: &Config, i: u64) -> f64 {
        let (p, m, v) = (c.pp, c.num_micro_batches, c.virtual_stages);
        match c.schedule {
            PipelineSchedule::GPipe => m as f64,
            PipelineSchedule::OneFOneB => (p - i).min(m) as f64,
            // Megatron's interleaved warm-up: 2(p−i−1) + (v−1)p chunks, plus
            // the one in its steady state (Korthikanti et al. 2022, eq. 5).
            PipelineSchedule::Interleaved => {
                ((2 * (p - i - 1) + (v - 1) * p + 1).min(m * v)) as f64 / v as f64
            }
        }
    }
}

/// The model's layer ranges stage `i` runs, one per chunk (one unless
/// interleaved), when the stages hold `counts` layers.
fn stage_ranges(c: &Config, counts: &[u64], i: usize) -> Vec<Range<u64>> {
    let mut ranges = Vec::new();
    let mut start = 0;
    for (k, n) in dplc_ir::virtual_stage_layers(counts, chunks(c))
        .into_iter()
        .enumerate()
    {
        if k % counts.len() == i {
            ranges.push(start..start + n);
        }
        start += n;
    }
    ranges
}

/// Add `shares` to `out`, one entry per stack.
fn merge(out: &mut Vec<StackShare>, shares: impl IntoIterator<Item = StackShare>) {
    for sh in shares {
        match out.iter_mut().find(|o| o.stack == sh.stack) {
            Some(o) => {
                o.layers += sh.layers;
                o.first |= sh.first;
            }
            None => out.push(sh),
        }
    }
}

/// Model chunks per stage: `v` when interleaved, else one.
pub(crate) fn chunks(c: &Config) -> u64 {
    if c.schedule == PipelineSchedule::Interleaved {
        c.virtual_stages.max(1)
    } else {
        1
    }
}
