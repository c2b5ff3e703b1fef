//! A minimal reader of the safetensors format (no crates): 8-byte little-endian header length N, N bytes
//! of JSON `{"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, "__metadata__": {..}}`,
//! then the raw little-endian data (tensor bytes at `8 + N + b .. 8 + N + e`).
//! Shared by the sample test (`tests/sample.rs`) and `examples/perplexity.rs` through `#[path]`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// An error reading the file.
#[derive(Debug)]
pub struct ReadError(pub String);

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for ReadError {}

fn err<T>(msg: impl Into<String>) -> Result<T, ReadError> {
    Err(ReadError(msg.into()))
}

// ------------------------------------------------------------------------------------------- JSON

/// A JSON value (just what the header needs).
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(kv) => kv.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_usize_vec(&self) -> Option<Vec<usize>> {
        match self {
            Json::Arr(a) => a
                .iter()
                .map(|v| match v {
                    Json::Num(x) if *x >= 0.0 && x.fract() == 0.0 && *x < 9.0e15 => Some(*x as usize),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    fn ws(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn expect(&mut self, c: u8) -> Result<(), ReadError> {
        self.ws();
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            err(format!("JSON: expected '{}' at byte {}", c as char, self.i))
        }
    }
    fn value(&mut self) -> Result<Json, ReadError> {
        self.ws();
        match self.peek() {
            Some(b'{') => {
                self.i += 1;
                let mut kv = Vec::new();
                self.ws();
                if self.peek() == Some(b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(kv));
                }
                loop {
                    self.ws();
                    let k = self.string()?;
                    self.expect(b':')?;
                    let v = self.value()?;
                    kv.push((k, v));
                    self.ws();
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Json::Obj(kv));
                        }
                        _ => return err(format!("JSON: expected ',' or '}}' at byte {}", self.i)),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut a = Vec::new();
                self.ws();
                if self.peek() == Some(b']') {
                    self.i += 1;
                    return Ok(Json::Arr(a));
                }
                loop {
                    a.push(self.value()?);
                    self.ws();
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Json::Arr(a));
                        }
                        _ => return err(format!("JSON: expected ',' or ']' at byte {}", self.i)),
                    }
                }
            }
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(b't') if self.s[self.i..].starts_with(b"true") => {
                self.i += 4;
                Ok(Json::Bool(true))
            }
            Some(b'f') if self.s[self.i..].starts_with(b"false") => {
                self.i += 5;
                Ok(Json::Bool(false))
            }
            Some(b'n') if self.s[self.i..].starts_with(b"null") => {
                self.i += 4;
                Ok(Json::Null)
            }
            Some(c) if c == b'-' || c.is_ascii_digit() => {
                let start = self.i;
                while self.i < self.s.len() && matches!(self.s[self.i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
                t.parse::<f64>().map(Json::Num).or_else(|_| err(format!("JSON: bad number {:?}", t)))
            }
            _ => err(format!("JSON: unexpected input at byte {}", self.i)),
        }
    }
    fn hex4(&mut self) -> Result<u32, ReadError> {
        let h = self.s.get(self.i..self.i + 4).ok_or_else(|| ReadError("JSON: short \\u escape".into()))?;
        let t = std::str::from_utf8(h).map_err(|_| ReadError("JSON: bad \\u escape".into()))?;
        self.i += 4;
        u32::from_str_radix(t, 16).map_err(|_| ReadError("JSON: bad \\u escape".into()))
    }
    fn string(&mut self) -> Result<String, ReadError> {
        self.ws();
        if self.peek() != Some(b'"') {
            return err(format!("JSON: expected a string at byte {}", self.i));
        }
        self.i += 1;
        let mut out: Vec<u8> = Vec::new();
        loop {
            let c = match self.peek() {
                Some(c) => c,
                None => return err("JSON: unterminated string"),
            };
            self.i += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let e = self.peek().ok_or_else(|| ReadError("JSON: bad escape".into()))?;
                    self.i += 1;
                    let ch = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let mut cp = self.hex4()?;
                            if (0xd800..0xdc00).contains(&cp) && self.s[self.i..].starts_with(b"\\u") {
                                self.i += 2;
                                let lo = self.hex4()?;
                                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo.wrapping_sub(0xdc00) & 0x3ff);
                            }
                            char::from_u32(cp).unwrap_or('\u{fffd}')
                        }
                        _ => return err("JSON: bad escape"),
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
                _ => out.push(c),
            }
        }
        String::from_utf8(out).map_err(|_| ReadError("JSON: string is not UTF-8".into()))
    }
}

/// Parses one JSON document.
pub fn parse_json(text: &[u8]) -> Result<Json, ReadError> {
    let mut p = Parser { s: text, i: 0 };
    let v = p.value()?;
    p.ws();
    if p.i != text.len() {
        return err(format!("JSON: trailing data at byte {}", p.i));
    }
    Ok(v)
}

// ----------------------------------------------------------------------------------- safetensors

/// One tensor's header entry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub dtype: String,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

/// A safetensors file read into memory.
pub struct SafeTensors {
    pub metadata: BTreeMap<String, String>,
    pub entries: BTreeMap<String, Entry>,
    bytes: Vec<u8>,
    data_start: usize,
}

fn elem_size(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "U8" | "I8" | "BOOL" => 1,
        _ => return None,
    })
}

impl SafeTensors {
    /// Reads and checks the whole file (header, offsets inside the file, byte spans = shape × dtype).
    pub fn open(path: &Path) -> Result<SafeTensors, ReadError> {
        let bytes = std::fs::read(path).map_err(|e| ReadError(format!("{}: {}", path.display(), e)))?;
        if bytes.len() < 8 {
            return err("safetensors: file shorter than 8 bytes");
        }
        let mut n8 = [0u8; 8];
        n8.copy_from_slice(&bytes[..8]);
        let n = u64::from_le_bytes(n8);
        if n > (bytes.len() - 8) as u64 {
            return err("safetensors: header length past the end of the file");
        }
        let n = n as usize;
        let header = parse_json(&bytes[8..8 + n])?;
        let data_start = 8 + n;
        let mut metadata = BTreeMap::new();
        let mut entries = BTreeMap::new();
        let kv = match header {
            Json::Obj(kv) => kv,
            _ => return err("safetensors: header is not a JSON object"),
        };
        for (name, v) in kv {
            if name == "__metadata__" {
                if let Json::Obj(m) = v {
                    for (k, val) in m {
                        if let Json::Str(s) = val {
                            metadata.insert(k, s);
                        }
                    }
                }
                continue;
            }
            let dtype =
                v.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| ReadError(format!("{}: no dtype", name)))?;
            let shape = v
                .get("shape")
                .and_then(|s| s.as_usize_vec())
                .ok_or_else(|| ReadError(format!("{}: no shape", name)))?;
            let off = v
                .get("data_offsets")
                .and_then(|s| s.as_usize_vec())
                .filter(|o| o.len() == 2 && o[0] <= o[1])
                .ok_or_else(|| ReadError(format!("{}: bad data_offsets", name)))?;
            let es = elem_size(dtype).ok_or_else(|| ReadError(format!("{}: unknown dtype {}", name, dtype)))?;
            let count = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            if count.and_then(|c| c.checked_mul(es)) != Some(off[1] - off[0]) {
                return err(format!(
                    "{}: byte span {} does not match shape {:?} of {}",
                    name,
                    off[1] - off[0],
                    shape,
                    dtype
                ));
            }
            if data_start + off[1] > bytes.len() {
                return err(format!("{}: data past the end of the file", name));
            }
            entries.insert(name, Entry { dtype: dtype.to_string(), shape, begin: off[0], end: off[1] });
        }
        Ok(SafeTensors { metadata, entries, bytes, data_start })
    }

    /// The entry of tensor `name`, checked to have `dtype`.
    pub fn entry(&self, name: &str, dtype: &str) -> Result<&Entry, ReadError> {
        let e = self.entries.get(name).ok_or_else(|| ReadError(format!("tensor {} missing", name)))?;
        if e.dtype != dtype {
            return err(format!("tensor {} is {}, expected {}", name, e.dtype, dtype));
        }
        Ok(e)
    }

    fn raw(&self, e: &Entry) -> &[u8] {
        &self.bytes[self.data_start + e.begin..self.data_start + e.end]
    }

    /// A tensor's elements as f32 (dtype F32), with its shape.
    pub fn f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), ReadError> {
        let e = self.entry(name, "F32")?;
        let v = self.raw(e).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok((v, e.shape.clone()))
    }

    /// A tensor's elements as f64 (dtype F64), with its shape.
    pub fn f64(&self, name: &str) -> Result<(Vec<f64>, Vec<usize>), ReadError> {
        let e = self.entry(name, "F64")?;
        let v = self
            .raw(e)
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        Ok((v, e.shape.clone()))
    }

    /// A tensor's elements as i32 (dtype I32), with its shape.
    pub fn i32(&self, name: &str) -> Result<(Vec<i32>, Vec<usize>), ReadError> {
        let e = self.entry(name, "I32")?;
        let v = self.raw(e).chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok((v, e.shape.clone()))
    }

    /// A BF16 tensor's bit patterns, with its shape.
    pub fn bf16_bits(&self, name: &str) -> Result<(Vec<u16>, Vec<usize>), ReadError> {
        let e = self.entry(name, "BF16")?;
        let v = self.raw(e).chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        Ok((v, e.shape.clone()))
    }
}
