//! The float element types the CUDA backend computes in, and what each is
//! called by the kernels (`kernels/dtype.cuh`) and cuBLAS.

use cudarc::cublas::sys::cudaDataType;
use lanes_adaptor::DType;

/// A float element type: f32, or a 16-bit one (stored as its bits,
/// computed in f32 registers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Elem {
    F32,
    F16,
    Bf16,
}

impl Elem {
    /// Every element type a typed kernel is instantiated for.
    pub const ALL: [Elem; 3] = [Elem::F32, Elem::F16, Elem::Bf16];

    /// The element type of a float dtype; `None` for integers.
    pub fn of(dtype: DType) -> Option<Elem> {
        match dtype {
            DType::F32 => Some(Elem::F32),
            DType::F16 => Some(Elem::F16),
            DType::BF16 => Some(Elem::Bf16),
            DType::I64 => None,
        }
    }

    /// What a typed kernel's entry point has after its name
    /// (`FOR_FLOATS` in `kernels/elementwise.cu`).
    pub fn suffix(self) -> &'static str {
        match self {
            Elem::F32 => "",
            Elem::F16 => "_f16",
            Elem::Bf16 => "_bf16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 | Elem::Bf16 => 2,
        }
    }

    /// cuBLAS's name for it (`cublasGemmEx`'s A/B/C types).
    pub fn blas(self) -> cudaDataType {
        match self {
            Elem::F32 => cudaDataType::CUDA_R_32F,
            Elem::F16 => cudaDataType::CUDA_R_16F,
            Elem::Bf16 => cudaDataType::CUDA_R_16BF,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Typed entry points are distinct per element type, the f32 one the
    /// plain name the f32-only call sites use.
    #[test]
    fn suffixes_are_distinct() {
        let s: Vec<&str> = Elem::ALL.iter().map(|e| e.suffix()).collect();
        assert_eq!(s, ["", "_f16", "_bf16"]);
        assert_eq!(Elem::of(DType::F32), Some(Elem::F32));
        assert_eq!(Elem::of(DType::F16), Some(Elem::F16));
        assert_eq!(Elem::of(DType::BF16), Some(Elem::Bf16));
        assert_eq!(Elem::of(DType::I64), None);
        for e in Elem::ALL {
            let d = [DType::F32, DType::F16, DType::BF16][e as usize];
            assert_eq!(e.size(), d.size(), "{e:?}");
        }
        assert_eq!(Elem::F16.size() + Elem::Bf16.size(), Elem::F32.size());
    }
}
