//! Work dealt to the machine's cores: each worker takes the next item when
//! it is done with one, and the results come back in the items' order.
//!
//! The planner's independent pieces (an e-graph per degree, the search's
//! meshes, the what-ifs) differ in cost by an order of magnitude, so a fixed
//! deal would leave a core idle. Results are returned in item order, so a
//! caller that folds them in that order is as deterministic as a loop.

use std::sync::atomic::{AtomicUsize, Ordering};

/// `f` applied to each item, with a state per worker made by `state` (a
/// cache its items share), on up to as many threads as the machine has
/// cores; the results in the items' order.
pub(crate) fn map_with<T, S, R>(
    items: &[T],
    state: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, &T) -> R + Sync,
) -> Vec<R>
where
    T: Sync,
    R: Send,
{
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items.len());
    if threads <= 1 {
        let mut s = state();
        return items.iter().map(|item| f(&mut s, item)).collect();
    }
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, R)> = std::thread::scope(|scope| {
        let (state, f, next) = (&state, &f, &next);
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(move || {
                    let mut s = state();
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break done };
                        done.push((i, f(&mut s, item)));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    done.sort_unstable_by_key(|&(i, _)| i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// `f` applied to each item as [`map_with`] deals them, with no state.
pub(crate) fn map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    map_with(items, || (), |(), item| f(item))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_item_order() {
        let items: Vec<u64> = (0..100).collect();
        // Uneven work, so the workers finish out of order.
        let out = map(&items, |&i| {
            std::thread::sleep(std::time::Duration::from_micros((i % 7) * 50));
            i * i
        });
        assert_eq!(out, items.iter().map(|i| i * i).collect::<Vec<_>>());
    }

    #[test]
    fn each_worker_keeps_its_state() {
        let items: Vec<u64> = (1..=40).collect();
        // A running count per worker: every item sees at least itself.
        let out = map_with(
            &items,
            || 0u64,
            |seen, _| {
                *seen += 1;
                *seen
            },
        );
        assert!(out.iter().all(|&n| n >= 1));
        assert_eq!(out.len(), items.len());
    }
}
