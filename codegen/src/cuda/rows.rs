//! Row kernels (`space.inner` set): a warp per narrow row, a block per wide
//! one or one with a running sum, and rows that are columns in memory
//! side by side — how each walks its row and reduces it.

use super::*;

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
        None => e.lane_count(Some(inner_size)),
    };
    // Rows that are columns in memory go side by side; a narrow row
    // of a fixed width is a warp's; a wide one, or one with a
    // running sum (a block-wide exchange), a block's.
    let columns = scan.is_none() && e.reads_columns(along);
    let lanes = if columns { 1 } else { lanes };
    let warp_row = !columns
        && scan.is_none()
        && matches!(inner_size, Size::Const(c) if c / lanes as i64 <= WARP_ROW_VECTORS);
    let launch = if columns {
        LaunchShape::Columns {
            block: COLUMN_BLOCK,
        }
    } else if warp_row {
        LaunchShape::WarpRows { block: ROW_BLOCK }
    } else {
        LaunchShape::Rows { block: ROW_BLOCK }
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
    let mut done = vec![false; kernel.values.len()];
    let j_loop = |deps: &[usize], section: Vec<S>| {
        let scans: Vec<usize> = deps
            .iter()
            .copied()
            .filter(|&i| matches!(kernel.values[i], Expr::Scan { .. }))
            .collect();
        if let (false, Some(reverse)) = (scans.is_empty(), scan) {
            return scan_tiles(&scans, reverse, inner_size, section);
        }
        let to = match (lanes, inner_size) {
            (1, s) => size(s),
            (n, Size::Const(c)) => C::Lit(format!("{}LL", c / n as i64)),
            _ => unreachable!("lanes need a fixed row"),
        };
        let walk = S::For {
            var: if lanes > 1 { "jv".into() } else { "j".into() },
            from: in_row.clone(),
            to,
            step: row_threads.clone(),
            body: section,
        };
        // Unrolled, a thread's loads along the row are in flight
        // together: a load feeding the running reduction otherwise
        // waits out its latency before the next is issued. Not
        // where the row draws dropout: four draws at once (64-bit
        // hashing) cost more than they hide. On the H200 unrolling
        // took a column sum from 468 to 62 µs and the layernorms
        // 3–8% faster, and the dropout layernorm backward from 804
        // to 1,391 µs.
        if columns || !kernel.uses_random() {
            S::Block(vec![S::Line("#pragma unroll 4".into()), walk])
        } else {
            walk
        }
    };
    let lanes_ref = (lanes > 1).then_some(&l);
    let row_values = |upto: usize, done: &mut Vec<bool>, out: &mut Vec<S>| {
        for i in 0..upto {
            if !done[i] && !along[i] && !matches!(kernel.values[i], Expr::Reduce { .. }) {
                done[i] = true;
                out.push(decl("float", format!("v{i}"), e.value(i, &|_| None)));
            }
        }
    };
    for (i, v) in kernel.values.iter().enumerate() {
        let Expr::Reduce { kind, value } = v else {
            continue;
        };
        row_values(i, &mut done, &mut row);
        let deps = e.along_deps(&[value.0 as usize], along);
        let init = match kind {
            RowReduce::Sum => C::Lit("0.0f".into()),
            RowReduce::Max => float_lit(f64::NEG_INFINITY),
        };
        let mut block = vec![var("float", "acc", Some(init))];
        block.push(j_loop(
            &deps,
            e.section(&deps, &[], Some((*kind, value.0 as usize)), lanes_ref),
        ));
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
        row.push(j_loop(
            &deps,
            e.section(&deps, &elem_stores, None, lanes_ref),
        ));
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
