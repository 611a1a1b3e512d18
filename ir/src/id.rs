//! Typed ids into the graph's arenas.
//! Every id is a newtype over `u32`, printed with the short prefix the textual IR uses.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! entity {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub struct $name(u32);

        impl $name {
            /// The id of the `index`-th entity of its arena.
            pub fn new(index: usize) -> Self {
                Self(u32::try_from(index).expect("arena holds fewer than 2^32 entities"))
            }
            /// Position in the arena.
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }
    };
}

entity!(
    /// A value: the output of a node or an argument of a region.
    TensorId, "%"
);
entity!(
    /// An operation in a region.
    NodeId, "n"
);
entity!(
    /// A list of nodes with arguments and results: the model body or a `repeat` body.
    RegionId, "r"
);
entity!(
    /// Where a node came from: the model, a block instance or a `repeat`.
    ScopeId, "s"
);
entity!(
    /// A trainable parameter (one per iteration when it lies in a `repeat` body).
    ParamId, "p"
);
entity!(
    /// A named model input such as `tokens`.
    InputId, "in"
);
entity!(
    /// A symbolic dimension such as `batch` or `seq`.
    SymId, "$"
);
