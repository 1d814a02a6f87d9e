//! Memory-mapped safetensors checkpoints: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Headers are validated when opened (a truncated or corrupt file is an
//! error naming it); tensor bytes stay in the page cache until a backend converts them.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;
use safetensors::tensor::Dtype as StDtype;

use crate::error::ModelError;

/// Element types we can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    BF16,
    F16,
    F32,
    /// Packed integers (GPTQ `qweight` / `qzeros` / `g_idx`): never converted on their own.
    I32,
    /// FP8 e4m3fn (block-FP8 weights): meaningful only with their `weight_scale_inv`.
    F8E4M3,
    /// Any other safetensors dtype (kept so that the error can name it).
    Other(&'static str),
}

impl DType {
    fn from_st(d: StDtype) -> Self {
        match d {
            StDtype::BF16 => Self::BF16,
            StDtype::F16 => Self::F16,
            StDtype::F32 => Self::F32,
            StDtype::I64 => Self::Other("I64"),
            StDtype::I32 => Self::I32,
            StDtype::I8 => Self::Other("I8"),
            StDtype::U8 => Self::Other("U8"),
            StDtype::F8_E4M3 => Self::F8E4M3,
            StDtype::F64 => Self::Other("F64"),
            _ => Self::Other("unsupported"),
        }
    }
    /// Bytes per element, for the dtypes this crate reads.
    pub fn size(self) -> Option<usize> {
        match self {
            Self::F8E4M3 => Some(1),
            Self::BF16 | Self::F16 => Some(2),
            Self::F32 | Self::I32 => Some(4),
            Self::Other(_) => None,
        }
    }
    /// The safetensors name of the dtype.
    pub fn name(self) -> &'static str {
        match self {
            Self::BF16 => "BF16",
            Self::F16 => "F16",
            Self::F32 => "F32",
            Self::I32 => "I32",
            Self::F8E4M3 => "F8_E4M3",
            Self::Other(d) => d,
        }
    }
    /// True for the floating-point dtypes [`TensorRef::bytes_to_f32`] converts on their own.
    pub fn is_float(self) -> bool {
        matches!(self, Self::BF16 | Self::F16 | Self::F32)
    }
}

/// One tensor's location inside a mapped shard.
#[derive(Clone, Debug)]
struct Entry {
    shard: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Absolute byte range in the shard file.
    start: usize,
    end: usize,
}

/// A view of one stored tensor.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl TensorRef<'_> {
    /// Converts (a byte range of) the tensor to f32. `bytes` must be a whole number of elements.
    pub fn bytes_to_f32(name: &str, dtype: DType, bytes: &[u8], out: &mut Vec<f32>) -> Result<(), ModelError> {
        match dtype {
            DType::F32 => out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
            DType::BF16 => out.extend(
                bytes.chunks_exact(2).map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
            ),
            DType::F16 => out
                .extend(bytes.chunks_exact(2).map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())),
            DType::I32 | DType::F8E4M3 => {
                return Err(ModelError::weights(format!(
                    "tensor `{name}` has dtype {}: it is quantised data that needs its scales \
                     (GPTQ qweight/qzeros/scales or FP8 weight_scale_inv) and cannot be read on its own",
                    dtype.name()
                )));
            }
            DType::Other(d) => {
                return Err(ModelError::weights(format!(
                    "tensor `{name}` has dtype {d}; only BF16, F16 and F32 are supported"
                )));
            }
        }
        Ok(())
    }

    /// The whole tensor as f32.
    pub fn to_f32(&self) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::with_capacity(self.shape.iter().product());
        Self::bytes_to_f32(self.name, self.dtype, self.bytes, &mut out)?;
        Ok(out)
    }
}

/// All tensors of a model directory, memory-mapped.
impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("dir", &self.dir).field("tensors", &self.entries.len()).finish()
    }
}

pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    entries: HashMap<String, Entry>,
}

impl Checkpoint {
    /// Opens `model.safetensors.index.json` + shards, or `model.safetensors`, or every `*.safetensors` in `dir`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::weights(format!("{}: invalid JSON: {e}", index.display())))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::weights(format!("{}: missing object `weight_map`", index.display())))?;
            let mut names = BTreeSet::new();
            for (tensor, file) in map {
                let f = file.as_str().ok_or_else(|| {
                    ModelError::weights(format!("{}: weight_map[{tensor}] is not a file name", index.display()))
                })?;
                if f.contains('/') || f.contains("..") {
                    return Err(ModelError::weights(format!(
                        "{}: shard name `{f}` is not a plain file name",
                        index.display()
                    )));
                }
                names.insert(f.to_string());
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if dir.join("model.safetensors").exists() {
            vec![dir.join("model.safetensors")]
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
            let mut v: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            v
        };
        if files.is_empty() {
            return Err(ModelError::weights(format!("{}: no *.safetensors files found", dir.display())));
        }
        Self::map(dir, files)
    }

    /// Opens one safetensors file (e.g. a fixture's reference tensors), whatever its name.
    pub fn open_file(path: &Path) -> Result<Self, ModelError> {
        Self::map(path.parent().unwrap_or(Path::new(".")), vec![path.to_path_buf()])
    }

    /// Memory-maps `files` (the shards of the checkpoint in `dir`) and indexes their tensors.
    fn map(dir: &Path, files: Vec<PathBuf>) -> Result<Self, ModelError> {
        let mut shards = Vec::with_capacity(files.len());
        let mut entries = HashMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the file is opened read-only; like every mmap-based loader we assume it is
            // not truncated by another process while mapped.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let (header_len, meta) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| ModelError::weights(format!("{}: not a valid safetensors file ({e})", path.display())))?;
            let base = 8 + header_len;
            for (name, info) in meta.tensors() {
                let entry = Entry {
                    shard: i,
                    dtype: DType::from_st(info.dtype),
                    shape: info.shape.clone(),
                    start: base + info.data_offsets.0,
                    end: base + info.data_offsets.1,
                };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(ModelError::weights(format!(
                        "tensor `{name}` appears in more than one shard ({})",
                        path.display()
                    )));
                }
            }
            shards.push((path, mmap));
        }
        Ok(Self { dir: dir.to_path_buf(), shards, entries })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.entries.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Looks a tensor up.
    pub fn get(&self, name: &str) -> Result<TensorRef<'_>, ModelError> {
        let (key, e) = self.entries.get_key_value(name).ok_or_else(|| ModelError::MissingTensor {
            name: name.to_string(),
            hint: format!(" ({} holds {} tensors)", self.dir.display(), self.entries.len()),
        })?;
        Ok(TensorRef { name: key, dtype: e.dtype, shape: &e.shape, bytes: &self.shards[e.shard].1[e.start..e.end] })
    }

    /// Looks a tensor up and checks its shape.
    pub fn get_shaped(&self, name: &str, expected: &[usize]) -> Result<TensorRef<'_>, ModelError> {
        let t = self.get(name)?;
        if t.shape != expected {
            return Err(ModelError::Shape { name: name.into(), expected: expected.to_vec(), found: t.shape.to_vec() });
        }
        Ok(t)
    }
}

/// Header entry of a tensor to write with [`write_safetensors`].
pub struct TensorHeader {
    pub name: String,
    /// BF16, F16, F32, I32 or F8E4M3.
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// Streams a safetensors file: the header first, then the bytes of tensor `i` as produced by
/// `fill(i, buf)` (which must push exactly numel × dtype size bytes), so large files never sit in memory.
pub fn write_safetensors(
    path: &Path,
    tensors: &[TensorHeader],
    mut fill: impl FnMut(usize, &mut Vec<u8>) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    use std::io::Write;
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    let mut sizes = Vec::with_capacity(tensors.len());
    for t in tensors {
        let (name, size) = match t.dtype.size() {
            Some(size) if !matches!(t.dtype, DType::Other(_)) => (t.dtype.name(), size),
            _ => {
                return Err(ModelError::weights(format!("cannot write tensor `{}` as {}", t.name, t.dtype.name())));
            }
        };
        let bytes = t.shape.iter().product::<usize>() * size;
        header.insert(
            t.name.clone(),
            serde_json::json!({ "dtype": name, "shape": t.shape, "data_offsets": [offset, offset + bytes] }),
        );
        sizes.push(bytes);
        offset += bytes;
    }
    let mut header =
        serde_json::to_vec(&serde_json::Value::Object(header)).map_err(|e| ModelError::weights(e.to_string()))?;
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    replace_file(path, |partial| {
        let file = File::create(partial).map_err(|e| ModelError::io(partial, e))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        let io = |e| ModelError::io(partial, e);
        w.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
        w.write_all(&header).map_err(io)?;
        let mut buf = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            buf.clear();
            fill(i, &mut buf)?;
            if buf.len() != sizes[i] {
                return Err(ModelError::weights(format!(
                    "tensor `{}`: produced {} bytes, expected {}",
                    t.name,
                    buf.len(),
                    sizes[i]
                )));
            }
            w.write_all(&buf).map_err(io)?;
        }
        w.flush().map_err(io)
    })
}

/// Writes `path` by `write` into a file beside it (`path` + `.partial-PID-N`), then renames that over it: a
/// reader never maps a half-written or truncated file (a process that has the old one mapped keeps
/// reading the old bytes). On an error the partial file is removed and `path` is left as it was.
pub(crate) fn replace_file(path: &Path, write: impl FnOnce(&Path) -> Result<(), ModelError>) -> Result<(), ModelError> {
    // A name of its own per write (process and counter): two writers of one file (tests of one process
    // writing the same model) never share a partial file, and the last rename wins whole.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut partial = path.as_os_str().to_owned();
    partial.push(format!(".partial-{}-{n}", std::process::id()));
    let partial = PathBuf::from(partial);
    if let Err(e) = write(&partial) {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    std::fs::rename(&partial, path).map_err(|e| ModelError::io(path, e))
}

/// Writes f32 tensors (name, shape, values) to a safetensors file.
pub fn write_f32_safetensors(path: &Path, tensors: &[(&str, Vec<usize>, &[f32])]) -> Result<(), ModelError> {
    let headers: Vec<TensorHeader> = tensors
        .iter()
        .map(|(n, s, _)| TensorHeader { name: n.to_string(), dtype: DType::F32, shape: s.clone() })
        .collect();
    write_safetensors(path, &headers, |i, buf| {
        buf.extend(tensors[i].2.iter().flat_map(|v| v.to_le_bytes()));
        Ok(())
    })
}
