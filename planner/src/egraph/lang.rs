//! The language of sharded tensor programs: the IR's ops of one region as
//! e-nodes tagged by their node id, layout annotations and explicit collectives.

use dplc_ir::NodeId;
use egg::Id;
use std::fmt;
use std::str::FromStr;

egg::define_language! {
    /// Every tensor-valued e-class denotes what one rank holds: `(shard tp 2 x)`
    /// is this rank's slice of `x` along axis 2 over the tensor-parallel group,
    /// `(partial tp x)` its summand of `x`. An IR op applied to annotated
    /// operands is the local op on local data; its layout follows from theirs.
    pub enum ShardLang {
        "shard" = Shard([Id; 3]),
        "partial" = Partial([Id; 2]),
        "all-reduce" = AllReduce([Id; 2]),
        "all-gather" = AllGather([Id; 3]),
        "reduce-scatter" = ReduceScatter([Id; 3]),
        "all-to-all" = AllToAll([Id; 3]),
        "arg" = Arg(Id),
        "param" = Param(Id),
        "leaf" = Leaf(Id),
        "matmul" = MatMul([Id; 3]),
        "unary" = Unary([Id; 2]),
        "binary" = Binary([Id; 3]),
        "norm" = Norm(Box<[Id]>),
        "softmax" = Softmax([Id; 2]),
        "reshape" = Reshape([Id; 2]),
        "transpose" = Transpose([Id; 2]),
        "expand" = Expand([Id; 2]),
        "slice" = Slice([Id; 2]),
        "concat" = Concat(Box<[Id]>),
        "reduce" = Reduce([Id; 2]),
        "embedding" = Embedding([Id; 3]),
        "take-along" = TakeAlong([Id; 3]),
        "topk" = TopK([Id; 2]),
        "moe-dispatch" = MoeDispatch([Id; 3]),
        "moe-combine" = MoeCombine([Id; 4]),
        "opaque" = Opaque(Box<[Id]>),
        Mesh(MeshAxis),
        Tag(OpTag),
        Num(i64),
    }
}

impl ShardLang {
    /// The node tag and the tensor operands of an IR op e-node.
    pub fn tagged(&self) -> Option<(Id, &[Id])> {
        use ShardLang::*;
        let ch: &[Id] = match self {
            MatMul(c) | Binary(c) | Embedding(c) | TakeAlong(c) | MoeDispatch(c) => c,
            Unary(c) | Softmax(c) | Reshape(c) | Transpose(c) | Expand(c) | Slice(c)
            | Reduce(c) | TopK(c) => c,
            MoeCombine(c) => c,
            Norm(c) | Concat(c) | Opaque(c) => c,
            Param(c) | Leaf(c) => std::slice::from_ref(c),
            _ => return None,
        };
        Some((ch[0], &ch[1..]))
    }
}

/// A mesh axis a layout or collective refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MeshAxis {
    /// Tensor parallelism (and sequence parallelism, which reuses its group).
    Tp,
    /// Expert parallelism.
    Ep,
    /// Context parallelism.
    Cp,
}

impl MeshAxis {
    pub const ALL: [MeshAxis; 3] = [MeshAxis::Tp, MeshAxis::Ep, MeshAxis::Cp];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            MeshAxis::Tp => "tp",
            MeshAxis::Ep => "ep",
            MeshAxis::Cp => "cp",
        }
    }
}

impl fmt::Display for MeshAxis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for MeshAxis {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        MeshAxis::ALL.into_iter().find(|m| m.name() == s).ok_or(())
    }
}

/// Output `output` of IR node `node`, printed `n12` (output 0) or `n12.1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpTag {
    pub node: NodeId,
    pub output: u8,
}

impl fmt::Display for OpTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.output {
            0 => write!(f, "{}", self.node),
            k => write!(f, "{}.{k}", self.node),
        }
    }
}

impl FromStr for OpTag {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        let rest = s.strip_prefix('n').ok_or(())?;
        let (node, output) = match rest.split_once('.') {
            Some((n, k)) => (n, k.parse().map_err(|_| ())?),
            None => (rest, 0),
        };
        let node: usize = node.parse().map_err(|_| ())?;
        Ok(OpTag {
            node: NodeId::new(node),
            output,
        })
    }
}
