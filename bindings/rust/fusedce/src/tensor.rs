//! Borrowed tensor views that become DLPack `DLTensor`s for the duration of one call.
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr;

use crate::error::{Error, Result, Status};
use crate::sys;

/// Element types the library accepts (`DLDataType` with `lanes == 1`).
///
/// Floating inputs may be `F32`, `BF16` or `F16`; index inputs (targets, top-K ids, argmax outputs)
/// `I32` or `I64`. Which argument accepts which is documented on each op.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32 (`kDLFloat`, 32 bits); Rust `f32`.
    F32,
    /// bfloat16 (`kDLBfloat`, 16 bits), stored as `u16` bit patterns (the upper half of an `f32`).
    BF16,
    /// IEEE binary16 (`kDLFloat`, 16 bits), stored as `u16` bit patterns.
    F16,
    /// 32-bit signed integer (`kDLInt`, 32 bits); Rust `i32`.
    I32,
    /// 64-bit signed integer (`kDLInt`, 64 bits); Rust `i64`.
    I64,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
        }
    }

    /// The DLPack descriptor (`lanes` = 1).
    pub fn to_dl(self) -> sys::DLDataType {
        let (code, bits) = match self {
            DType::F32 => (sys::kDLFloat, 32),
            DType::BF16 => (sys::kDLBfloat, 16),
            DType::F16 => (sys::kDLFloat, 16),
            DType::I32 => (sys::kDLInt, 32),
            DType::I64 => (sys::kDLInt, 64),
        };
        sys::DLDataType { code: code as u8, bits, lanes: 1 }
    }
}

/// Where a tensor's memory lives (`DLDevice`). Tensors built from Rust slices are always [`Device::Cpu`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory (`kDLCPU`); used with a CPU handle.
    Cpu,
    /// CUDA device memory on the given ordinal (`kDLCUDA`); used with a CUDA handle of that ordinal.
    Cuda(i32),
    /// CUDA managed memory on the given ordinal (`kDLCUDAManaged`); used with a CUDA handle.
    CudaManaged(i32),
    /// Pinned host memory (`kDLCUDAHost`); the CPU backend accepts it.
    CudaHost,
}

impl Device {
    /// The DLPack descriptor.
    pub fn to_dl(self) -> sys::DLDevice {
        let (t, id) = match self {
            Device::Cpu => (sys::kDLCPU, 0),
            Device::Cuda(id) => (sys::kDLCUDA, id),
            Device::CudaManaged(id) => (sys::kDLCUDAManaged, id),
            Device::CudaHost => (sys::kDLCUDAHost, 0),
        };
        sys::DLDevice { device_type: t, device_id: id }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
}

/// Rust element types with a fixed [`DType`]: `f32`, `i32`, `i64`. For bf16 and fp16 data use `u16`
/// bit patterns with the `*_bits` constructors and an explicit dtype tag.
pub trait Element: sealed::Sealed + Copy + 'static {
    /// The dtype of this element type.
    const DTYPE: DType;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}

/// The most dimensions a view has: 3, for the `[W, N, K]` records of the vocabulary-parallel combines
/// ([`crate::Handle::cross_entropy_combine`], `logsumexp_combine`, `kd_combine`, `kd_terms_combine`);
/// every other argument of every op has at most 2 (an lse's pairs are `[N, 2]`).
const MAX_NDIM: usize = 3;

/// What both view types hold: enough to build a `DLTensor` (ndim <= [`MAX_NDIM`], as every op needs).
#[derive(Copy, Clone, Debug)]
struct Layout {
    data: *mut c_void,
    dtype: DType,
    device: Device,
    ndim: i32,
    shape: [i64; MAX_NDIM],
    strides: Option<[i64; MAX_NDIM]>,
    byte_offset: u64,
}

impl Layout {
    /// The DLTensor; its shape/strides pointers point into `self`, so it is valid while `self` is
    /// borrowed and not moved.
    fn dl(&self) -> sys::DLTensor {
        sys::DLTensor {
            data: self.data,
            device: self.device.to_dl(),
            ndim: self.ndim,
            dtype: self.dtype.to_dl(),
            shape: self.shape.as_ptr() as *mut i64,
            strides: match &self.strides {
                Some(s) => s.as_ptr() as *mut i64,
                None => ptr::null_mut(),
            },
            byte_offset: self.byte_offset,
        }
    }

    fn shape(&self) -> &[i64] {
        &self.shape[..self.ndim as usize]
    }

    /// A host view over `len` elements at `data`; checks that `shape` (and the row stride) stay
    /// inside the slice.
    fn host(data: *mut c_void, len: usize, dtype: DType, shape: &[usize], row_stride: Option<usize>) -> Result<Layout> {
        if shape.len() > MAX_NDIM {
            return Err(Error::new(
                Status::SHAPE_MISMATCH,
                format!("fusedce (Rust): a tensor has at most {} dimensions; got shape {:?}", MAX_NDIM, shape),
            ));
        }
        let overflow = || Error::new(Status::OVERFLOW, format!("fusedce (Rust): shape {:?} overflows", shape));
        let mut dims = [0i64; MAX_NDIM];
        for (d, &s) in dims.iter_mut().zip(shape) {
            *d = i64::try_from(s).map_err(|_| overflow())?;
        }
        let (needed, strides) = match (shape, row_stride) {
            // Contiguous row-major, any rank up to MAX_NDIM: the product of the extents (1 for a scalar).
            (_, None) => (shape.iter().try_fold(1usize, |a, &s| a.checked_mul(s)).ok_or_else(overflow)?, None),
            ([r, c], Some(s)) => {
                if s < *c {
                    return Err(Error::new(
                        Status::UNSUPPORTED_LAYOUT,
                        format!("fusedce (Rust): row stride {} is smaller than the row length {}", s, c),
                    ));
                }
                let need = if *r == 0 || *c == 0 {
                    0
                } else {
                    (r - 1).checked_mul(s).and_then(|x| x.checked_add(*c)).ok_or_else(overflow)?
                };
                (need, Some([i64::try_from(s).map_err(|_| overflow())?, 1, 0]))
            }
            (_, Some(_)) => {
                return Err(Error::new(
                    Status::SHAPE_MISMATCH,
                    "fusedce (Rust): a row stride needs a 2-D shape [rows, cols]",
                ))
            }
        };
        let ok = if strides.is_some() { len >= needed } else { len == needed };
        if !ok {
            return Err(Error::new(
                Status::SHAPE_MISMATCH,
                format!(
                    "fusedce (Rust): a slice of {} elements cannot be viewed as shape {:?}{} ({} elements {})",
                    len,
                    shape,
                    row_stride.map(|s| format!(" with row stride {}", s)).unwrap_or_default(),
                    needed,
                    if strides.is_some() { "at least" } else { "exactly" }
                ),
            ));
        }
        Ok(Layout { data, dtype, device: Device::Cpu, ndim: shape.len() as i32, shape: dims, strides, byte_offset: 0 })
    }

    unsafe fn raw(
        data: *mut c_void,
        dtype: DType,
        device: Device,
        shape: &[i64],
        strides: Option<&[i64]>,
        byte_offset: u64,
    ) -> Result<Layout> {
        if shape.len() > MAX_NDIM {
            return Err(Error::new(
                Status::SHAPE_MISMATCH,
                format!("fusedce (Rust): a tensor has at most {} dimensions; got shape {:?}", MAX_NDIM, shape),
            ));
        }
        let mut dims = [0i64; MAX_NDIM];
        dims[..shape.len()].copy_from_slice(shape);
        let strides = match strides {
            None => None,
            Some(s) if s.len() == shape.len() => {
                let mut st = [0i64; MAX_NDIM];
                st[..s.len()].copy_from_slice(s);
                Some(st)
            }
            Some(s) => {
                return Err(Error::new(
                    Status::SHAPE_MISMATCH,
                    format!("fusedce (Rust): {} strides for {} dimensions", s.len(), shape.len()),
                ))
            }
        };
        Ok(Layout { data, dtype, device, ndim: shape.len() as i32, shape: dims, strides, byte_offset })
    }
}

/// N of an `[N, 2]` lse of `len` values.
fn pairs_rows(len: usize) -> Result<usize> {
    if len % 2 != 0 {
        return Err(Error::new(
            Status::SHAPE_MISMATCH,
            format!("fusedce (Rust): an lse of pairs [N, 2] needs an even length; got {} values", len),
        ));
    }
    Ok(len / 2)
}

fn half_dtype(dtype: DType) -> Result<DType> {
    match dtype {
        DType::BF16 | DType::F16 => Ok(dtype),
        other => Err(Error::new(
            Status::UNSUPPORTED_DTYPE,
            format!("fusedce (Rust): u16 bit patterns are BF16 or F16, not {:?}", other),
        )),
    }
}

/// A read-only tensor view (an input): a borrowed host slice, or (unsafe) raw memory on any device.
///
/// Shapes have 0, 1 or 2 dimensions: a scalar, a vector `[n]`, or a row-major matrix `[rows, cols]`
/// whose rows may be padded (`row_stride >= cols`, in elements); or 3, contiguous row-major
/// (`[W, N, K]`: only the records of the vocabulary-parallel combines take one). Constructors check that the shape
/// stays inside the slice, so safe code can never make the library read out of bounds. Building a
/// view does not validate it against an op; the op does that and returns an [`Error`].
#[derive(Copy, Clone, Debug)]
pub struct TensorRef<'a> {
    layout: Layout,
    _borrow: PhantomData<&'a [u8]>,
}

/// A writable tensor view (an output): a borrowed mutable host slice, or (unsafe) raw memory.
///
/// Same shapes and checks as [`TensorRef`]. Holding the `&mut` borrow guarantees that no other view
/// aliases it, so the library's aliasing checks can only fire for views built with `unsafe`.
#[derive(Debug)]
pub struct TensorMut<'a> {
    layout: Layout,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> TensorRef<'a> {
    /// A contiguous row-major view of `data` with `shape` (`[]`, `[n]`, `[rows, cols]` or
    /// `[a, rows, cols]`); `data.len()` must equal the product of `shape` (1 for a scalar).
    pub fn new<T: Element>(data: &'a [T], shape: &[usize]) -> Result<Self> {
        let l = Layout::host(data.as_ptr() as *mut c_void, data.len(), T::DTYPE, shape, None)?;
        Ok(TensorRef { layout: l, _borrow: PhantomData })
    }

    /// A `[rows, cols]` view whose rows start `row_stride` elements apart (`row_stride >= cols`);
    /// `data.len()` must be at least `(rows - 1) * row_stride + cols`.
    pub fn strided<T: Element>(data: &'a [T], rows: usize, cols: usize, row_stride: usize) -> Result<Self> {
        let l = Layout::host(data.as_ptr() as *mut c_void, data.len(), T::DTYPE, &[rows, cols], Some(row_stride))?;
        Ok(TensorRef { layout: l, _borrow: PhantomData })
    }

    /// A 1-D view `[data.len()]`.
    pub fn vector<T: Element>(data: &'a [T]) -> Self {
        Self::new(data, &[data.len()]).expect("a vector view always fits its slice")
    }

    /// A `[rows, cols]` contiguous matrix view; `data.len()` must be `rows * cols`.
    pub fn matrix<T: Element>(data: &'a [T], rows: usize, cols: usize) -> Result<Self> {
        Self::new(data, &[rows, cols])
    }

    /// A 0-D (scalar) view of one value.
    pub fn scalar<T: Element>(value: &'a T) -> Self {
        Self::new(std::slice::from_ref(value), &[]).expect("a scalar view always fits")
    }

    /// An lse in its pair form: the `[N, 2]` view of `data` = `[m_0, l_0, m_1, l_1, ...]`, N =
    /// `data.len() / 2` (see [`crate::CeOutputs::lse`]); an odd length is `SHAPE_MISMATCH`. The same as
    /// [`TensorRef::matrix`]`(data, data.len() / 2, 2)`.
    pub fn lse_pairs(data: &'a [f32]) -> Result<Self> {
        Self::new(data, &[pairs_rows(data.len())?, 2])
    }

    /// A contiguous view of bf16 or fp16 data given as `u16` bit patterns; `dtype` must be
    /// [`DType::BF16`] or [`DType::F16`] (else `UNSUPPORTED_DTYPE`).
    pub fn from_bits(data: &'a [u16], dtype: DType, shape: &[usize]) -> Result<Self> {
        let l = Layout::host(data.as_ptr() as *mut c_void, data.len(), half_dtype(dtype)?, shape, None)?;
        Ok(TensorRef { layout: l, _borrow: PhantomData })
    }

    /// [`TensorRef::from_bits`] with padded rows, as [`TensorRef::strided`].
    pub fn strided_bits(data: &'a [u16], dtype: DType, rows: usize, cols: usize, row_stride: usize) -> Result<Self> {
        let l = Layout::host(
            data.as_ptr() as *mut c_void,
            data.len(),
            half_dtype(dtype)?,
            &[rows, cols],
            Some(row_stride),
        )?;
        Ok(TensorRef { layout: l, _borrow: PhantomData })
    }

    /// A view of raw memory, e.g. a CUDA device pointer for a CUDA handle.
    ///
    /// `shape` has at most 3 extents; `strides` (in elements, one per dimension) or None for row-major;
    /// `byte_offset` is added to `data` by the library.
    ///
    /// # Safety
    /// `data + byte_offset` must address every element the shape and strides describe, of the given
    /// dtype, on `device`, and stay valid and unmodified for `'a` — on CUDA, until the work enqueued on
    /// the handle's stream that reads it has completed.
    pub unsafe fn from_raw_parts(
        data: *const c_void,
        dtype: DType,
        device: Device,
        shape: &[i64],
        strides: Option<&[i64]>,
        byte_offset: u64,
    ) -> Result<Self> {
        let l = Layout::raw(data as *mut c_void, dtype, device, shape, strides, byte_offset)?;
        Ok(TensorRef { layout: l, _borrow: PhantomData })
    }

    /// The extents (0 to 3 of them).
    pub fn shape(&self) -> &[i64] {
        self.layout.shape()
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }
    /// The device the memory lives on.
    pub fn device(&self) -> Device {
        self.layout.device
    }
    /// The DLPack descriptor; its `shape`/`strides` point into `self`, so it is valid only while
    /// `self` is neither moved nor dropped.
    pub fn as_dl(&self) -> sys::DLTensor {
        self.layout.dl()
    }
}

impl<'a> TensorMut<'a> {
    /// A contiguous row-major view of `data` with `shape` (`[]`, `[n]`, `[rows, cols]` or
    /// `[a, rows, cols]`); `data.len()` must equal the product of `shape` (1 for a scalar).
    pub fn new<T: Element>(data: &'a mut [T], shape: &[usize]) -> Result<Self> {
        let l = Layout::host(data.as_mut_ptr() as *mut c_void, data.len(), T::DTYPE, shape, None)?;
        Ok(TensorMut { layout: l, _borrow: PhantomData })
    }

    /// A `[rows, cols]` view whose rows start `row_stride` elements apart (`row_stride >= cols`);
    /// the padding between rows is never written.
    pub fn strided<T: Element>(data: &'a mut [T], rows: usize, cols: usize, row_stride: usize) -> Result<Self> {
        let l = Layout::host(data.as_mut_ptr() as *mut c_void, data.len(), T::DTYPE, &[rows, cols], Some(row_stride))?;
        Ok(TensorMut { layout: l, _borrow: PhantomData })
    }

    /// A 1-D view `[data.len()]`.
    pub fn vector<T: Element>(data: &'a mut [T]) -> Self {
        let n = data.len();
        Self::new(data, &[n]).expect("a vector view always fits its slice")
    }

    /// A `[rows, cols]` contiguous matrix view; `data.len()` must be `rows * cols`.
    pub fn matrix<T: Element>(data: &'a mut [T], rows: usize, cols: usize) -> Result<Self> {
        Self::new(data, &[rows, cols])
    }

    /// A 0-D (scalar) view of one value (e.g. a reduced loss).
    pub fn scalar<T: Element>(value: &'a mut T) -> Self {
        Self::new(std::slice::from_mut(value), &[]).expect("a scalar view always fits")
    }

    /// An lse output in its pair form: the `[N, 2]` view of `data`, N = `data.len() / 2`, into which the
    /// library writes each row's (m, l), lse = m + l (see [`crate::CeOutputs::lse`]); an odd length is
    /// `SHAPE_MISMATCH`. The same as [`TensorMut::matrix`]`(data, data.len() / 2, 2)`.
    pub fn lse_pairs(data: &'a mut [f32]) -> Result<Self> {
        let rows = pairs_rows(data.len())?;
        Self::new(data, &[rows, 2])
    }

    /// A contiguous view of bf16 or fp16 data as `u16` bit patterns (`dtype` BF16 or F16).
    pub fn from_bits(data: &'a mut [u16], dtype: DType, shape: &[usize]) -> Result<Self> {
        let l = Layout::host(data.as_mut_ptr() as *mut c_void, data.len(), half_dtype(dtype)?, shape, None)?;
        Ok(TensorMut { layout: l, _borrow: PhantomData })
    }

    /// [`TensorMut::from_bits`] with padded rows, as [`TensorMut::strided`].
    pub fn strided_bits(
        data: &'a mut [u16],
        dtype: DType,
        rows: usize,
        cols: usize,
        row_stride: usize,
    ) -> Result<Self> {
        let l = Layout::host(
            data.as_mut_ptr() as *mut c_void,
            data.len(),
            half_dtype(dtype)?,
            &[rows, cols],
            Some(row_stride),
        )?;
        Ok(TensorMut { layout: l, _borrow: PhantomData })
    }

    /// A writable view of raw memory, e.g. a CUDA device pointer for a CUDA handle.
    ///
    /// # Safety
    /// As [`TensorRef::from_raw_parts`], and nothing else may read or write that memory while the view
    /// lives and (on CUDA) until the work enqueued on the handle's stream has completed.
    pub unsafe fn from_raw_parts(
        data: *mut c_void,
        dtype: DType,
        device: Device,
        shape: &[i64],
        strides: Option<&[i64]>,
        byte_offset: u64,
    ) -> Result<Self> {
        let l = Layout::raw(data, dtype, device, shape, strides, byte_offset)?;
        Ok(TensorMut { layout: l, _borrow: PhantomData })
    }

    /// A read-only view of the same memory, borrowing `self`.
    pub fn as_ref(&self) -> TensorRef<'_> {
        TensorRef { layout: self.layout, _borrow: PhantomData }
    }

    /// A shorter-lived writable view of the same memory, borrowing `self` mutably.
    pub fn reborrow(&mut self) -> TensorMut<'_> {
        TensorMut { layout: self.layout, _borrow: PhantomData }
    }

    /// The extents (0 to 3 of them).
    pub fn shape(&self) -> &[i64] {
        self.layout.shape()
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }
    /// The device the memory lives on.
    pub fn device(&self) -> Device {
        self.layout.device
    }
    /// The DLPack descriptor; valid only while `self` is neither moved nor dropped.
    pub fn as_dl(&mut self) -> sys::DLTensor {
        self.layout.dl()
    }
}

impl<'a> From<TensorMut<'a>> for TensorRef<'a> {
    fn from(t: TensorMut<'a>) -> TensorRef<'a> {
        TensorRef { layout: t.layout, _borrow: PhantomData }
    }
}

/// Conversions between `f32` and the 16-bit float bit patterns the `*_bits` constructors take.
pub mod bits {
    /// The bf16 bit pattern nearest to `x` (round to nearest, ties to even; NaN stays a quiet NaN).
    pub fn f32_to_bf16(x: f32) -> u16 {
        let u = x.to_bits();
        if (u & 0x7fff_ffff) > 0x7f80_0000 {
            return ((u >> 16) | 0x40) as u16;
        }
        ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
    }

    /// The `f32` value of a bf16 bit pattern (exact).
    pub fn bf16_to_f32(b: u16) -> f32 {
        f32::from_bits((b as u32) << 16)
    }

    /// The fp16 bit pattern nearest to `x` (round to nearest, ties to even; overflow to infinity).
    pub fn f32_to_f16(x: f32) -> u16 {
        let u = x.to_bits();
        let sign = ((u >> 16) & 0x8000) as u16;
        let a = u & 0x7fff_ffff;
        if a > 0x7f80_0000 {
            return sign | 0x7e00;
        }
        if a >= 0x477f_f000 {
            return sign | 0x7c00; // >= 65520 rounds to infinity
        }
        if a < 0x3880_0000 {
            // subnormal (or zero) in fp16: value = a / 2^-24 rounded
            if a < 0x3300_0000 {
                return sign;
            }
            let e = a >> 23;
            let man = (a & 0x7f_ffff) | 0x80_0000;
            let s = 126 - e; // 14..=24
            let mut r = man >> s;
            let rem = man & ((1 << s) - 1);
            let half = 1 << (s - 1);
            if rem > half || (rem == half && (r & 1) == 1) {
                r += 1;
            }
            return sign | r as u16;
        }
        let mut r = (a >> 13) - (112 << 10);
        let rem = a & 0x1fff;
        if rem > 0x1000 || (rem == 0x1000 && (r & 1) == 1) {
            r += 1;
        }
        sign | r as u16
    }

    /// The `f32` value of an fp16 bit pattern (exact, subnormals included).
    pub fn f16_to_f32(h: u16) -> f32 {
        let sign = ((h as u32) & 0x8000) << 16;
        let exp = ((h >> 10) & 0x1f) as u32;
        let man = (h & 0x3ff) as u32;
        let u = if exp == 0x1f {
            sign | 0x7f80_0000 | (man << 13)
        } else if exp != 0 {
            sign | ((exp + 112) << 23) | (man << 13)
        } else if man == 0 {
            sign
        } else {
            // subnormal: man * 2^-24
            return f32::from_bits(sign) + (if sign != 0 { -1.0 } else { 1.0 }) * (man as f32) * (2.0f32).powi(-24);
        };
        f32::from_bits(u)
    }
}
