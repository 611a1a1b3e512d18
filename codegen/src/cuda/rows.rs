//! Row kernels (`space.inner` set): a warp per narrow row, a block per wide
//! one or one with a running sum, and rows that are columns in memory
//! side by side — how each walks its row and reduces it.

use super::*;
use crate::kernel::ValueId;
use std::collections::BTreeMap;

/// The statements of a row kernel whose rows have `inner_size` elements,
/// and how it launches.
pub(super) fn row_kernel(
    e: &Emit,
    along: &[bool],
    scan: Option<bool>,
    inner_size: Size,
) -> (Vec<S>, LaunchShape) {
    let kernel = e.k;
    let mut body = Vec::new();
    // A running sum walks the row in tiles of one element a thread.
    let lanes = match scan {
        Some(_) => 1,
        None => e.lane_count(Some(inner_size), &Idx::Inner),
    };
    // Rows that are columns in memory go side by side; a narrow row
    // of a fixed width is a warp's; a wide one, or one with a
    // running sum (a block-wide exchange), a block's.
    let columns = scan.is_none() && e.reads_columns(along);
    let lanes = if columns { 1 } else { lanes };
    // A wide row of a length no multiple of the vector (GPT-2's 50,257
    // logits) still walks in 16-byte vectors when every access along it
    // shares one base: each row starts `dplc_head` elements short of an
    // aligned address, walked one at a time, as is the tail.
    let phased = if scan.is_none() && !columns && lanes == 1 {
        phased_base(e, inner_size)
    } else {
        None
    };
    let lanes = match &phased {
        Some((_, n)) => *n,
        None => lanes,
    };
    let warp_row = !columns
        && scan.is_none()
        && phased.is_none()
        && matches!(inner_size, Size::Const(c) if c / lanes as i64 <= WARP_ROW_VECTORS);
    let launch = if columns {
        LaunchShape::Columns {
            block: COLUMN_BLOCK,
        }
    } else if warp_row {
        LaunchShape::WarpRows { block: ROW_BLOCK }
    } else {
        LaunchShape::Rows { block: e.row_block }
    };
    // Who walks a row: a warp's lanes, a column's group of threads,
    // or the block's threads.
    let (in_row, row_threads) = if warp_row {
        (id("dplc_lane"), C::Lit("32LL".into()))
    } else if columns {
        (id("dplc_first"), id("dplc_groups"))
    } else {
        (
            C::Cast("long long", Box::new(id("threadIdx.x"))),
            C::Cast("long long", Box::new(id("blockDim.x"))),
        )
    };
    let l = Lanes {
        var: Idx::Inner,
        count: lanes,
        phased: phased.as_ref().map(|(base, _)| base.clone()),
    };
    let outer = &kernel.space.outer;
    let mut rows = C::Lit("1LL".into());
    for (a, &s) in outer.iter().enumerate() {
        rows = if a == 0 {
            size(s)
        } else {
            bin("*", rows, size(s))
        };
    }
    if warp_row {
        body.push(S::Line(
            "const long long dplc_lane = threadIdx.x & 31;".into(),
        ));
        body.push(S::Line(
            "const long long dplc_warps = blockDim.x >> 5, dplc_warp = threadIdx.x >> 5;".into(),
        ));
    } else if columns {
        body.push(S::Line(format!("__shared__ float red[{COLUMN_BLOCK}];")));
        body.push(S::Line(format!(
            "const long long dplc_col = threadIdx.x % {COLUMN_TILE}, \
                 dplc_group = threadIdx.x / {COLUMN_TILE}, \
                 dplc_groups = blockDim.x / {COLUMN_TILE};"
        )));
    } else {
        body.push(S::Line("__shared__ float red[32];".into()));
    }
    body.push(decl("long long", "rows", rows));
    let mut row = Vec::new();
    if columns {
        // Every thread goes through every reduction's barriers: one
        // past the last row computes the last row's values and
        // walks and stores nothing.
        row.push(S::Line(format!(
            "const long long dplc_row = tile * {COLUMN_TILE} + dplc_col;"
        )));
        row.push(S::Line("const bool dplc_live = dplc_row < rows;".into()));
        row.push(S::Line(
            "const long long row = dplc_live ? dplc_row : rows - 1;".into(),
        ));
        row.push(decl(
            "long long",
            "dplc_first",
            C::Cond(
                Box::new(id("dplc_live")),
                Box::new(id("dplc_group")),
                Box::new(size(inner_size)),
            ),
        ));
    }
    row.extend(decompose("row", outer, None));
    let (draws, draws_ok) = e.row_draws(inner_size);
    row.extend(draws);
    if let Some((base, n)) = &phased {
        // Elements before the first aligned one, the vectors after them,
        // and where the tail starts.
        let n = C::Lit(format!("{n}LL"));
        let head = bin(
            "%",
            bin("-", n.clone(), bin("%", index(base), n.clone())),
            n.clone(),
        );
        row.push(decl(
            "long long",
            "dplc_head",
            call("dplc_imin", vec![head, size(inner_size)]),
        ));
        row.push(decl(
            "long long",
            "dplc_vectors",
            bin("/", bin("-", size(inner_size), id("dplc_head")), n.clone()),
        ));
        row.push(decl(
            "long long",
            "dplc_tail",
            bin("+", id("dplc_head"), bin("*", id("dplc_vectors"), n)),
        ));
    }
    // The row's work: its reductions and stores. Where its draws read the
    // row's sample from the preamble, twice: with them, and with each
    // element splitting its own index should the row span two samples.
    let body_for = |e: &Emit| -> Vec<S> {
        let mut row = Vec::new();
        let mut done = vec![false; kernel.values.len()];
        let lanes_ref = (lanes > 1).then_some(&l);
        let j_loop = |deps: &[usize], section: &dyn Fn(Option<&Lanes>) -> Vec<S>| {
            let scans: Vec<usize> = deps
                .iter()
                .copied()
                .filter(|&i| matches!(kernel.values[i], Expr::Scan { .. }))
                .collect();
            if let (false, Some(reverse)) = (scans.is_empty(), scan) {
                return scan_tiles(&scans, reverse, inner_size, section(None));
            }
            let to = match (lanes, inner_size, &phased) {
                (_, _, Some(_)) => id("dplc_vectors"),
                (1, s, None) => size(s),
                (n, Size::Const(c), None) => C::Lit(format!("{}LL", c / n as i64)),
                _ => unreachable!("lanes need a fixed row"),
            };
            let walk = S::For {
                var: if lanes > 1 { "jv".into() } else { "j".into() },
                from: in_row.clone(),
                to,
                step: row_threads.clone(),
                body: section(lanes_ref),
            };
            // Unrolled, a thread's loads along the row are in flight
            // together: a load feeding the running reduction otherwise
            // waits out its latency before the next is issued. Not
            // where the row draws dropout: four draws at once (64-bit
            // hashing) cost more than they hide. On the H200 unrolling
            // took a column sum from 468 to 62 µs and the layernorms
            // 3–8% faster, and the dropout layernorm backward from 804
            // to 1,391 µs. A column's walk loads one 4-byte element a
            // step (the 16-byte vectors of a row are four times that), and
            // at four in flight a 32768 × 768 column sum still read at 41%
            // of the copy's rate: eight.
            let walk = if columns {
                S::Block(vec![S::Line("#pragma unroll 8".into()), walk])
            } else if !kernel.uses_random() {
                S::Block(vec![S::Line("#pragma unroll 4".into()), walk])
            } else {
                walk
            };
            if phased.is_none() {
                return walk;
            }
            // The unaligned head and the tail, an element a thread.
            let one_by_one = |from: C, to: C| S::For {
                var: "j".into(),
                from,
                to,
                step: row_threads.clone(),
                body: section(None),
            };
            S::Block(vec![
                one_by_one(in_row.clone(), id("dplc_head")),
                walk,
                one_by_one(bin("+", id("dplc_tail"), in_row.clone()), size(inner_size)),
            ])
        };
        let row_values = |upto: usize, done: &mut Vec<bool>, out: &mut Vec<S>| {
            for i in 0..upto {
                if !done[i] && !along[i] && !matches!(kernel.values[i], Expr::Reduce { .. }) {
                    done[i] = true;
                    out.push(decl("float", format!("v{i}"), e.value(i, &|_| None)));
                }
            }
        };
        // A softmax's maximum and its sum of exponentials walk the row
        // once, together (wide rows read from memory, so a second walk is
        // a second read of the row).
        let max_sums = if columns {
            BTreeMap::new()
        } else {
            max_sum_pairs(kernel)
        };
        for (i, v) in kernel.values.iter().enumerate() {
            let Expr::Reduce { kind, value } = v else {
                continue;
            };
            if done[i] {
                continue;
            }
            row_values(i, &mut done, &mut row);
            let deps = e.along_deps(&[value.0 as usize], along);
            if let Some(&sum) = max_sums.get(&i) {
                let (max_of, sum_of) = if warp_row {
                    ("dplc_warp_max(acc)", "dplc_warp_sum(dplc_s)")
                } else {
                    ("dplc_block_max(acc, red)", "dplc_block_sum(dplc_s, red)")
                };
                let block = vec![
                    var("float", "acc", Some(float_lit(f64::NEG_INFINITY))),
                    var("float", "accs", Some(C::Lit("0.0f".into()))),
                    j_loop(&deps, &|l| {
                        e.section(&deps, &[], Some(Fold::MaxSum(value.0 as usize)), l)
                    }),
                    S::Assign(id(format!("v{i}")), C::Lit(max_of.into())),
                    S::Line(format!(
                        "const float dplc_s = dplc_max_sum_rescale(acc, accs, v{i});"
                    )),
                    S::Assign(id(format!("v{sum}")), C::Lit(sum_of.into())),
                ];
                row.push(var("float", format!("v{i}"), None));
                row.push(var("float", format!("v{sum}"), None));
                row.push(S::Block(block));
                done[i] = true;
                done[sum] = true;
                continue;
            }
            let init = match kind {
                RowReduce::Sum => C::Lit("0.0f".into()),
                RowReduce::Max => float_lit(f64::NEG_INFINITY),
            };
            let mut block = vec![var("float", "acc", Some(init))];
            block.push(j_loop(&deps, &|l| {
                e.section(&deps, &[], Some(Fold::Row(*kind, value.0 as usize)), l)
            }));
            let reduced = match (kind, warp_row, columns) {
                (RowReduce::Sum, true, _) => call("dplc_warp_sum", vec![id("acc")]),
                (RowReduce::Max, true, _) => call("dplc_warp_max", vec![id("acc")]),
                (RowReduce::Sum, _, true) => call("dplc_column_sum", vec![id("acc"), id("red")]),
                (RowReduce::Max, _, true) => call("dplc_column_max", vec![id("acc"), id("red")]),
                (RowReduce::Sum, ..) => call("dplc_block_sum", vec![id("acc"), id("red")]),
                (RowReduce::Max, ..) => call("dplc_block_max", vec![id("acc"), id("red")]),
            };
            block.push(S::Assign(id(format!("v{i}")), reduced));
            row.push(var("float", format!("v{i}"), None));
            row.push(S::Block(block));
            done[i] = true;
        }
        row_values(kernel.values.len(), &mut done, &mut row);
        let (elem_stores, row_stores): (Vec<&Store>, Vec<&Store>) = kernel
            .stores
            .iter()
            .partition(|s| along[s.value.0 as usize] || s.index.uses_inner());
        if !elem_stores.is_empty() {
            let roots: Vec<usize> = elem_stores.iter().map(|s| s.value.0 as usize).collect();
            let deps = e.along_deps(&roots, along);
            row.push(j_loop(&deps, &|l| e.section(&deps, &elem_stores, None, l)));
        }
        if !row_stores.is_empty() {
            let stores = e.section(&[], &row_stores, None, None);
            let first_of_row = if columns {
                bin(
                    "&&",
                    id("dplc_live"),
                    bin("==", id("dplc_group"), C::Lit("0".into())),
                )
            } else {
                bin("==", in_row.clone(), C::Lit("0".into()))
            };
            row.push(S::If(first_of_row, stores));
        }
        row
    };
    match draws_ok {
        Some(ok) => {
            let plain = Emit { rows: false, ..*e };
            row.push(S::If(ok.clone(), body_for(e)));
            row.push(S::If(
                bin("==", ok, C::Lit("false".into())),
                body_for(&plain),
            ));
        }
        None => row.extend(body_for(e)),
    }
    let block_index = C::Cast("long long", Box::new(id("blockIdx.x")));
    let blocks = C::Cast("long long", Box::new(id("gridDim.x")));
    if columns {
        body.push(decl(
            "long long",
            "tiles",
            C::Lit(format!("(rows + {}) / {COLUMN_TILE}", COLUMN_TILE - 1)),
        ));
        body.push(S::For {
            var: "tile".into(),
            from: block_index,
            to: id("tiles"),
            step: blocks,
            body: row,
        });
    } else {
        let (first, step) = if warp_row {
            (
                bin(
                    "+",
                    bin("*", block_index, id("dplc_warps")),
                    id("dplc_warp"),
                ),
                bin("*", blocks, id("dplc_warps")),
            )
        } else {
            (block_index, blocks)
        };
        body.push(S::For {
            var: "row".into(),
            from: first,
            to: id("rows"),
            step,
            body: row,
        });
    }
    (body, launch)
}

/// The base every access along a wide row of `inner` elements shares,
/// and the vector's lanes, when the row's length is no multiple of them
/// (so rows start misaligned, each its own way): `None` for a narrow row,
/// one the plain walk vectorises, or one with an access along the row at
/// another base (a broadcast vector, a second tensor's row) or not
/// contiguous in it.
fn phased_base(e: &Emit, inner: Size) -> Option<(Idx, usize)> {
    let kernel = e.k;
    let lanes = 16 / e.widest_along(&Idx::Inner)?;
    let Size::Const(len) = inner else {
        return None;
    };
    if lanes < 2 || len % lanes as i64 == 0 || len / (lanes as i64) <= WARP_ROW_VECTORS {
        return None;
    }
    let loads = kernel.values.iter().filter_map(|v| match v {
        Expr::Load { buf, index } => Some((*buf, index)),
        _ => None,
    });
    let stores = kernel.stores.iter().map(|s| (s.buf, &s.index));
    let mut shared: Option<Idx> = None;
    for (buf, ix) in loads.chain(stores) {
        if kernel.buffers[buf].elem == Elem::I32 || !ix.uses_inner() {
            continue;
        }
        let base = ix.contiguous_in(&Idx::Inner)?;
        match &shared {
            Some(b) if *b != base => return None,
            _ => shared = Some(base),
        }
    }
    shared.map(|b| (b, lanes))
}

/// The softmax statistics a row kernel computes: `max → sum` for each row
/// maximum whose row sum of exponentials the kernel also takes
/// ([`Kernel::exp_sum_of_max`]).
fn max_sum_pairs(kernel: &Kernel) -> BTreeMap<usize, usize> {
    let mut pairs = BTreeMap::new();
    for i in 0..kernel.values.len() {
        if let Some((_, m)) = kernel.exp_sum_of_max(ValueId(i as u32)) {
            pairs.entry(m.0 as usize).or_insert(i);
        }
    }
    pairs
}
