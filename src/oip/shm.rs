//! Triton's system shared memory extension (`lanes serve
//! --system-shared-memory`): a client on this host puts a tensor in a
//! POSIX shared memory object, registers (a part of) the object once as a
//! named *region*, and then names the region in each inference request's
//! input or output parameters instead of sending the data, so that no
//! tensor crosses a socket.
//!
//! One code path for both front doors: REST and gRPC only parse their
//! messages into the arguments of [`Regions::register`],
//! [`Regions::unregister`] and [`Regions::status`], and an input's or
//! output's parameters into [`ShmParams`] ([`params`]).
//!
//! # What is opened
//!
//! Only an object the server can open by name in `/dev/shm` (where
//! `shm_open` keeps them on Linux): the key is `/NAME` or `NAME` with no
//! other `/`, opened read-write without following a symbolic link and
//! refused unless it is a regular file at least `offset + byte_size`
//! bytes long. Any local user who can open the object can read and write
//! it, as with Triton; that is why the extension is off unless asked for.
//!
//! # How bytes move
//!
//! The registered part is mapped once, at registration. An input is
//! copied once, from the mapping straight into the session's feed buffers
//! (as a binary input is from the request body: [`ShmSlice::read_into`]),
//! an output once, from the service's reply into the mapping
//! ([`ShmSlice::write_from`]). Positioned reads of the file (`pread`)
//! would need no `unsafe` and could never fault, but measured about three
//! times slower than a copy from a mapping on tmpfs (0.4 ms against
//! 0.13 ms for 4.8 MB), a price per request that the extension exists to
//! avoid.
//!
//! A mapping outlives its object's shrinking only by faulting (SIGBUS):
//! the object's size is checked again before every copy, which leaves the
//! window of one copy to an owner that shrinks its own object while
//! using it (Triton has the same). Unregistering drops the server's hold
//! on the mapping; requests already running keep theirs until they end.

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::{Arc, Mutex};

use super::error::ApiError;

/// Where `shm_open` keeps POSIX shared memory objects.
const SHM_DIR: &str = "/dev/shm";

/// Longest region name and object name (a file name's limit).
const MAX_NAME: usize = 255;

/// Default of [`Limits::max_regions`].
pub const DEFAULT_MAX_REGIONS: usize = 64;

/// Default of [`Limits::max_bytes`]: address space, not memory (the
/// object's pages are the client's).
pub const DEFAULT_MAX_BYTES: u64 = 64 << 30;

/// Bounds on what clients may have mapped at once.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most regions registered at once.
    pub max_regions: usize,
    /// Most bytes mapped for all regions together.
    pub max_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_regions: DEFAULT_MAX_REGIONS,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }
}

/// A region as its status lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionStatus {
    pub name: String,
    pub key: String,
    pub offset: u64,
    pub byte_size: u64,
}

/// A registered region: its object, kept open (its size is checked before
/// every copy), and the registered part of it, mapped read-write.
pub struct Region {
    status: RegionStatus,
    file: File,
    map: memmap2::MmapRaw,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("status", &self.status)
            .finish()
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::BadRequest(msg.into())
}

/// The object's file name in [`SHM_DIR`] of a key (`/NAME` or `NAME`).
fn object_name(key: &str) -> Result<&str, ApiError> {
    let name = key.strip_prefix('/').unwrap_or(key);
    let plain = !name.is_empty()
        && name.len() <= MAX_NAME
        && name != "."
        && name != ".."
        && !name.contains(['/', '\0']);
    if plain {
        Ok(name)
    } else {
        Err(bad(format!(
            "shared memory key `{key}` is not the name of an object in {SHM_DIR} (`/NAME`, no other `/`)"
        )))
    }
}

impl Region {
    /// Opens object `key` and maps `byte_size` bytes of it from `offset`.
    fn open(name: &str, key: &str, offset: u64, byte_size: u64) -> Result<Region, ApiError> {
        use std::os::unix::fs::OpenOptionsExt;
        let object = object_name(key)?;
        if byte_size == 0 {
            return Err(bad(format!("region `{name}`: byte_size must not be 0")));
        }
        let end = offset.checked_add(byte_size).ok_or_else(|| {
            bad(format!(
                "region `{name}`: offset {offset} + byte_size {byte_size} overflows"
            ))
        })?;
        let len = usize::try_from(byte_size).map_err(|_| {
            bad(format!(
                "region `{name}`: byte_size {byte_size} is too large"
            ))
        })?;
        let path = std::path::Path::new(SHM_DIR).join(object);
        // No symbolic link out of the directory, and no blocking open of
        // a FIFO someone left there.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| {
                bad(format!(
                    "region `{name}`: cannot open shared memory object `{key}` ({}): {e}",
                    path.display()
                ))
            })?;
        let meta = file
            .metadata()
            .map_err(|e| bad(format!("region `{name}`: cannot read `{key}`'s size: {e}")))?;
        if !meta.file_type().is_file() {
            return Err(bad(format!(
                "region `{name}`: `{key}` is not a shared memory object"
            )));
        }
        if meta.len() < end {
            return Err(bad(format!(
                "region `{name}`: shared memory object `{key}` has {} bytes, fewer than offset {offset} + byte_size {byte_size}",
                meta.len()
            )));
        }
        let map = memmap2::MmapOptions::new()
            .offset(offset)
            .len(len)
            .map_raw(&file)
            .map_err(|e| bad(format!("region `{name}`: cannot map `{key}`: {e}")))?;
        Ok(Region {
            status: RegionStatus {
                name: name.to_string(),
                key: key.to_string(),
                offset,
                byte_size,
            },
            file,
            map,
        })
    }

    /// Whether the object still holds the whole mapping (an owner may
    /// shrink it; touching a page past its end faults).
    fn still_backed(&self) -> bool {
        let end = self.status.offset.saturating_add(self.status.byte_size);
        self.file.metadata().is_ok_and(|m| m.len() >= end)
    }

    pub fn name(&self) -> &str {
        &self.status.name
    }
}

/// Bytes `offset..offset + len` of a registered region, checked to lie
/// inside it.
#[derive(Debug, Clone)]
pub struct ShmSlice {
    region: Arc<Region>,
    offset: usize,
    len: usize,
}

impl ShmSlice {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn region(&self) -> &str {
        self.region.name()
    }

    /// The offset in the region, as the request gave it.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Copies the slice into `dst`, which must be exactly as long; false
    /// (and `dst` untouched) when it is not, or when the object shrank.
    pub fn read_into(&self, dst: &mut [u8]) -> bool {
        if dst.len() != self.len || !self.region.still_backed() {
            return false;
        }
        // SAFETY: `offset + len` lies inside the mapping (checked when the
        // slice was made, `Regions::slice`), which lives as long as
        // `self.region`; the object was at least as long as the mapping
        // just above. `dst` is memory of this process that the mapping
        // cannot overlap. Another process may write the pages meanwhile:
        // the bytes are copied as bytes, and any value is a valid `u8`.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.region.map.as_ptr().add(self.offset),
                dst.as_mut_ptr(),
                self.len,
            );
        }
        true
    }

    /// Copies `src` to the start of the slice; an error when it does not
    /// fit, or when the object shrank.
    pub fn write_from(&self, what: &str, src: &[u8]) -> Result<(), ApiError> {
        if src.len() > self.len {
            return Err(bad(format!(
                "{what}: {} bytes do not fit shared_memory_byte_size {} of region `{}`",
                src.len(),
                self.len,
                self.region()
            )));
        }
        if !self.region.still_backed() {
            return Err(bad(format!(
                "{what}: shared memory object `{}` of region `{}` shrank below the region",
                self.region.status.key,
                self.region()
            )));
        }
        // SAFETY: as in `read_into`, with the copy's direction reversed:
        // `src.len() <= len` bytes from `offset`, inside the mapping, which
        // is writable (opened and mapped read-write).
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.region.map.as_mut_ptr().add(self.offset),
                src.len(),
            );
        }
        Ok(())
    }
}

/// An input's or output's shared memory parameters
/// (`shared_memory_region`, `shared_memory_offset`,
/// `shared_memory_byte_size`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmParams {
    pub region: String,
    pub offset: u64,
    pub byte_size: u64,
}

/// A parameter's value as either front door carries it.
#[derive(Debug, Clone, Copy)]
pub enum ParamValue<'a> {
    Text(&'a str),
    Int(i64),
    UInt(u64),
    /// Any other kind (a boolean, a float, an object).
    Other,
}

/// The shared memory parameters of tensor `tensor` (`what`: "input" or
/// "output"), read through `get`: `None` when it names no region.
pub fn params<'a>(
    what: &str,
    tensor: &str,
    get: impl Fn(&str) -> Option<ParamValue<'a>>,
) -> Result<Option<ShmParams>, ApiError> {
    let count = |key: &str| -> Result<Option<u64>, ApiError> {
        match get(key) {
            None => Ok(None),
            Some(ParamValue::UInt(n)) => Ok(Some(n)),
            Some(ParamValue::Int(n)) if n >= 0 => Ok(Some(n as u64)),
            Some(_) => Err(bad(format!(
                "{what} `{tensor}`: parameter `{key}` must be a byte count"
            ))),
        }
    };
    let offset = count("shared_memory_offset")?;
    let byte_size = count("shared_memory_byte_size")?;
    let region = match get("shared_memory_region") {
        None => {
            if offset.is_some() || byte_size.is_some() {
                return Err(bad(format!(
                    "{what} `{tensor}`: shared_memory_offset or shared_memory_byte_size without shared_memory_region"
                )));
            }
            return Ok(None);
        }
        Some(ParamValue::Text(r)) => r.to_string(),
        Some(_) => {
            return Err(bad(format!(
                "{what} `{tensor}`: parameter `shared_memory_region` must be a string"
            )))
        }
    };
    let byte_size = byte_size.ok_or_else(|| {
        bad(format!(
            "{what} `{tensor}`: shared_memory_region `{region}` without shared_memory_byte_size"
        ))
    })?;
    Ok(Some(ShmParams {
        region,
        offset: offset.unwrap_or(0),
        byte_size,
    }))
}

/// The registered regions, shared by both front doors.
#[derive(Debug)]
pub struct Regions {
    enabled: bool,
    limits: Limits,
    table: Mutex<BTreeMap<String, Arc<Region>>>,
}

impl Regions {
    /// The regions' table; `enabled: false` refuses every use.
    pub fn new(enabled: bool, limits: Limits) -> Regions {
        Regions {
            enabled,
            limits,
            table: Mutex::new(BTreeMap::new()),
        }
    }

    /// Whether the extension is on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    fn on(&self) -> Result<(), ApiError> {
        if self.enabled {
            Ok(())
        } else {
            Err(ApiError::Unsupported(
                "the system shared memory extension is off (lanes serve --system-shared-memory turns it on)".into(),
            ))
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<Region>>> {
        // A panic while the table was held cannot leave it half-changed
        // (every change is one insert or remove): go on with it.
        self.table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers `byte_size` bytes from `offset` of object `key` as region
    /// `name`.
    pub fn register(
        &self,
        name: &str,
        key: &str,
        offset: u64,
        byte_size: u64,
    ) -> Result<(), ApiError> {
        self.on()?;
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(bad(format!(
                "a region's name must have 1 to {MAX_NAME} bytes"
            )));
        }
        if self.lock().contains_key(name) {
            return Err(bad(format!(
                "region `{name}` is registered already (unregister it first)"
            )));
        }
        // Opened and mapped outside the lock (a slow file system must not
        // hold up every request naming a region); the limits are checked
        // again under it.
        let region = Region::open(name, key, offset, byte_size)?;
        let mut table = self.lock();
        if table.contains_key(name) {
            return Err(bad(format!(
                "region `{name}` is registered already (unregister it first)"
            )));
        }
        if table.len() >= self.limits.max_regions {
            return Err(ApiError::Overloaded(format!(
                "{} shared memory regions are registered, the most the server takes",
                table.len()
            )));
        }
        let mapped: u64 = table.values().map(|r| r.status.byte_size).sum();
        if mapped.saturating_add(byte_size) > self.limits.max_bytes {
            return Err(ApiError::Overloaded(format!(
                "region `{name}`: {byte_size} bytes more than the {mapped} mapped for regions already would pass the server's limit of {}",
                self.limits.max_bytes
            )));
        }
        table.insert(name.to_string(), Arc::new(region));
        Ok(())
    }

    /// Unregisters region `name`, or every region for `None`; a name not
    /// registered is no error (as Triton).
    pub fn unregister(&self, name: Option<&str>) -> Result<(), ApiError> {
        self.on()?;
        let mut table = self.lock();
        match name {
            Some(n) => {
                table.remove(n);
            }
            None => table.clear(),
        }
        Ok(())
    }

    /// Region `name`'s status, or every region's for `None`, by name.
    pub fn status(&self, name: Option<&str>) -> Result<Vec<RegionStatus>, ApiError> {
        self.on()?;
        let table = self.lock();
        match name {
            None => Ok(table.values().map(|r| r.status.clone()).collect()),
            Some(n) => table.get(n).map(|r| vec![r.status.clone()]).ok_or_else(|| {
                ApiError::NotFound(format!("no shared memory region `{n}` is registered"))
            }),
        }
    }

    /// Drops every region (at shutdown), whether or not the extension is on.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// The part of a registered region that `p` names for `what`
    /// `tensor`: inside the region, and of exactly `exact` bytes when
    /// given (an input's size).
    pub fn slice(
        &self,
        what: &str,
        tensor: &str,
        p: &ShmParams,
        exact: Option<usize>,
    ) -> Result<ShmSlice, ApiError> {
        self.on()?;
        let region = self.lock().get(&p.region).cloned().ok_or_else(|| {
            bad(format!(
                "{what} `{tensor}`: no shared memory region `{}` is registered",
                p.region
            ))
        })?;
        let size = region.status.byte_size;
        let inside = p.offset.checked_add(p.byte_size).is_some_and(|e| e <= size);
        if !inside {
            return Err(bad(format!(
                "{what} `{tensor}`: shared_memory_offset {} + shared_memory_byte_size {} pass the end of region `{}` ({size} bytes)",
                p.offset, p.byte_size, p.region
            )));
        }
        if let Some(want) = exact.filter(|&w| w as u64 != p.byte_size) {
            return Err(bad(format!(
                "{what} `{tensor}`: shared_memory_byte_size {} but its shape and datatype take {want} bytes",
                p.byte_size
            )));
        }
        // Both fit: they are inside a mapping of `size` bytes, a usize.
        let (offset, len) = (p.offset as usize, p.byte_size as usize);
        Ok(ShmSlice {
            region,
            offset,
            len,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// An object in /dev/shm of `len` bytes, removed on drop.
    struct Object(String);

    impl Object {
        fn new(tag: &str, len: u64) -> Object {
            let name = format!("lanes-test-{}-{tag}", std::process::id());
            let f = File::create(std::path::Path::new(SHM_DIR).join(&name)).unwrap();
            f.set_len(len).unwrap();
            Object(name)
        }
        fn key(&self) -> String {
            format!("/{}", self.0)
        }
    }

    impl Drop for Object {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(std::path::Path::new(SHM_DIR).join(&self.0));
        }
    }

    fn p(region: &str, offset: u64, byte_size: u64) -> ShmParams {
        ShmParams {
            region: region.into(),
            offset,
            byte_size,
        }
    }

    fn is_bad(r: Result<impl std::fmt::Debug, ApiError>, part: &str) {
        match r {
            Err(ApiError::BadRequest(m)) => assert!(m.contains(part), "{m}"),
            other => panic!("want BadRequest with `{part}`: {other:?}"),
        }
    }

    #[test]
    fn keys_name_objects_in_dev_shm_only() {
        assert_eq!(object_name("/abc").unwrap(), "abc");
        assert_eq!(object_name("abc").unwrap(), "abc");
        for k in ["", "/", "/a/b", "../etc/passwd", "/..", ".", "a\0b"] {
            assert!(object_name(k).is_err(), "{k:?}");
        }
    }

    #[test]
    fn registration_checks_the_object_and_the_limits() {
        let obj = Object::new("reg", 64);
        let regions = Regions::new(
            true,
            Limits {
                max_regions: 2,
                max_bytes: 100,
            },
        );
        is_bad(regions.register("r", &obj.key(), 0, 65), "has 64 bytes");
        is_bad(
            regions.register("r", &obj.key(), 60, 8),
            "fewer than offset 60",
        );
        is_bad(regions.register("r", &obj.key(), u64::MAX, 8), "overflows");
        is_bad(regions.register("r", &obj.key(), 0, 0), "must not be 0");
        is_bad(
            regions.register("r", "/lanes-no-such-object", 0, 8),
            "cannot open",
        );
        is_bad(regions.register("r", "/a/b", 0, 8), "not the name");
        regions.register("a", &obj.key(), 0, 64).unwrap();
        is_bad(
            regions.register("a", &obj.key(), 0, 8),
            "registered already",
        );
        assert!(matches!(
            regions.register("b", &obj.key(), 0, 40),
            Err(ApiError::Overloaded(m)) if m.contains("limit of 100")
        ));
        regions.register("b", &obj.key(), 8, 36).unwrap();
        assert!(matches!(
            regions.register("c", &obj.key(), 0, 1),
            Err(ApiError::Overloaded(m)) if m.contains("2 shared memory regions")
        ));
        let s = regions.status(None).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[1].name.as_str(), s[1].offset, s[1].byte_size),
            ("b", 8, 36)
        );
        assert!(matches!(
            regions.status(Some("q")),
            Err(ApiError::NotFound(_))
        ));
        regions.unregister(Some("a")).unwrap();
        regions.unregister(Some("never")).unwrap();
        assert_eq!(regions.status(None).unwrap().len(), 1);
        regions.unregister(None).unwrap();
        assert!(regions.status(None).unwrap().is_empty());
    }

    #[test]
    fn slices_read_and_write_inside_their_region_only() {
        let obj = Object::new("rw", 32);
        let regions = Regions::new(true, Limits::default());
        regions.register("r", &obj.key(), 8, 16).unwrap();
        let s = regions.slice("input", "x", &p("r", 4, 8), Some(8)).unwrap();
        s.write_from("output `y`", &[7u8; 8]).unwrap();
        let mut back = [0u8; 8];
        assert!(s.read_into(&mut back));
        assert_eq!(back, [7u8; 8]);
        // The object's bytes 12..20: the region starts at 8.
        let all = std::fs::read(std::path::Path::new(SHM_DIR).join(&obj.0)).unwrap();
        assert_eq!(&all[12..20], &[7u8; 8]);
        assert_eq!(all[11], 0);
        assert!(!s.read_into(&mut [0u8; 4]));
        is_bad(s.write_from("output `y`", &[1u8; 9]), "do not fit");
        is_bad(
            regions.slice("input", "x", &p("r", 12, 8), None),
            "pass the end",
        );
        is_bad(
            regions.slice("input", "x", &p("r", u64::MAX, 8), None),
            "pass the end",
        );
        is_bad(
            regions.slice("input", "x", &p("r", 0, 8), Some(4)),
            "take 4 bytes",
        );
        is_bad(
            regions.slice("input", "x", &p("q", 0, 8), None),
            "no shared memory region `q`",
        );
        // An object shrunk under its region is refused, not touched.
        File::options()
            .write(true)
            .open(std::path::Path::new(SHM_DIR).join(&obj.0))
            .unwrap()
            .set_len(4)
            .unwrap();
        assert!(!s.read_into(&mut back));
        is_bad(s.write_from("output `y`", &[1u8; 8]), "shrank");
    }

    #[test]
    fn off_refuses_everything() {
        let regions = Regions::new(false, Limits::default());
        assert!(matches!(
            regions.register("a", "/x", 0, 1),
            Err(ApiError::Unsupported(_))
        ));
        assert!(matches!(
            regions.status(None),
            Err(ApiError::Unsupported(_))
        ));
        assert!(matches!(
            regions.slice("input", "x", &p("a", 0, 1), None),
            Err(ApiError::Unsupported(_))
        ));
    }

    #[test]
    fn parameters_are_read_and_checked() {
        let get = |m: &'static [(&'static str, ParamValue<'static>)]| {
            move |k: &str| m.iter().find(|(n, _)| *n == k).map(|(_, v)| *v)
        };
        assert_eq!(params("input", "x", get(&[])).unwrap(), None);
        assert_eq!(
            params(
                "input",
                "x",
                get(&[
                    ("shared_memory_region", ParamValue::Text("r")),
                    ("shared_memory_byte_size", ParamValue::Int(16)),
                ])
            )
            .unwrap(),
            Some(p("r", 0, 16))
        );
        assert_eq!(
            params(
                "output",
                "y",
                get(&[
                    ("shared_memory_region", ParamValue::Text("r")),
                    ("shared_memory_byte_size", ParamValue::UInt(16)),
                    ("shared_memory_offset", ParamValue::UInt(4)),
                ])
            )
            .unwrap(),
            Some(p("r", 4, 16))
        );
        is_bad(
            params(
                "input",
                "x",
                get(&[("shared_memory_region", ParamValue::Text("r"))]),
            ),
            "without shared_memory_byte_size",
        );
        is_bad(
            params(
                "input",
                "x",
                get(&[("shared_memory_byte_size", ParamValue::Int(4))]),
            ),
            "without shared_memory_region",
        );
        is_bad(
            params(
                "input",
                "x",
                get(&[
                    ("shared_memory_region", ParamValue::Text("r")),
                    ("shared_memory_byte_size", ParamValue::Int(-4)),
                ]),
            ),
            "must be a byte count",
        );
        is_bad(
            params(
                "input",
                "x",
                get(&[("shared_memory_region", ParamValue::Int(1))]),
            ),
            "must be a string",
        );
    }
}
