//! Pinned maps across agent versions and configurations.
//!
//! The agent adopts the maps a previous agent pinned (Services, conntrack, socket LB
//! translations survive restarts). aya reuses a pinned map by name without looking at it, so a
//! map pinned with other sizes (the NetworkConfig's `mapSizes` changed, or a release changed a
//! key or value) would be used as it is. Before loading, every pinned map is compared with
//! what this agent's object declares:
//!
//! - same definition, same layout version: adopted as it is;
//! - same type, key and value, other capacity or flags: **copied** into a new map: the old pin
//!   is moved aside (`NAME_old`: bpffs refuses names with a dot, and renames), the loader
//!   creates the new map, the entries are copied, and after the programs are attached (links
//!   switch to the new programs atomically) the entries the old programs created meanwhile are
//!   copied again and the old pin is removed;
//! - another type, key or value, or a map that `LAYOUT_VERSION` says changed its meaning:
//!   **recreated** empty. The agent rewrites Services from its source; flows in a recreated
//!   conntrack map are lost.
//!
//! The layout version lives in the pinned `GN_LAYOUT` map (absent: version 0).
use std::{
    collections::HashMap,
    fs, io,
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use aya::maps::{MapData, MapInfo};
use gardenet_common::{LAYOUT_VERSION, MAP_LAYOUT};

/// Maps whose meaning changed in a layout version (without a size change), by version.
pub const CHANGED: &[(u32, &[&str])] = &[
    // 1: the layout carries a version (`GN_LAYOUT` is new); no map changed.
    (1, &[]),
];

/// A map definition, as the object declares it or the kernel reports a pinned one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapDef {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
}

/// What happens to one pinned map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Adopt,
    /// New capacity or flags, same entries: copy them over.
    Copy,
    /// Another layout: start empty.
    Recreate,
}

/// The verdict for a map pinned as `pinned` that this agent wants as `want`; `changed`: the
/// layout versions between the pin and this agent changed the map's meaning.
pub fn verdict(pinned: &MapDef, want: &MapDef, changed: bool) -> Verdict {
    if changed || pinned.map_type != want.map_type || pinned.key_size != want.key_size || pinned.value_size != want.value_size {
        Verdict::Recreate
    } else if pinned != want {
        Verdict::Copy
    } else {
        Verdict::Adopt
    }
}

/// Whether a layout change between versions `from` (pinned) and `to` (this agent) changed `map`.
pub fn changed_between(from: u32, to: u32, map: &str) -> bool {
    CHANGED.iter().any(|(v, maps)| *v > from && *v <= to && maps.contains(&map))
}

/// The pinned maps `object` declares, with the capacities in `sizes` (map name -> entries)
/// applied as the loader applies them.
pub fn expected(object: &[u8], sizes: &[(&str, u32)]) -> Result<HashMap<String, MapDef>> {
    let obj = aya_obj::Object::parse(object).context("parsing the eBPF object")?;
    Ok(obj
        .maps
        .iter()
        .filter(|(_, m)| m.pinning() == aya_obj::maps::PinningType::ByName)
        .map(|(name, m)| {
            let max_entries = sizes.iter().find(|(n, _)| n == name).map_or(m.max_entries(), |(_, s)| *s);
            let def = MapDef { map_type: m.map_type(), key_size: m.key_size(), value_size: m.value_size(), max_entries, flags: m.map_flags() };
            (name.clone(), def)
        })
        .collect())
}

/// Pinned maps being replaced: loaded new, the old ones still pinned as `NAME_old`.
#[derive(Debug, Default)]
pub struct Migration {
    /// (map name, copy entries?).
    pub maps: Vec<(String, Verdict)>,
    pin_dir: PathBuf,
}

fn old_pin(pin_dir: &Path, name: &str) -> PathBuf {
    pin_dir.join(format!("{name}_old"))
}

fn def_of(info: &MapInfo) -> MapDef {
    MapDef {
        map_type: info.map_type().map(|t| t as u32).unwrap_or(u32::MAX),
        key_size: info.key_size(),
        value_size: info.value_size(),
        max_entries: info.max_entries(),
        flags: info.map_flags(),
    }
}

/// The layout version of the maps pinned in `pin_dir` (0 when there is no `GN_LAYOUT`).
pub fn pinned_version(pin_dir: &Path) -> u32 {
    let Ok(data) = MapData::from_pin(pin_dir.join(MAP_LAYOUT)) else { return 0 };
    let mut v = [0u8; 4];
    match raw::lookup(data.fd().as_fd().as_raw_fd(), &0u32.to_ne_bytes(), &mut v) {
        Ok(true) => u32::from_ne_bytes(v),
        _ => 0,
    }
}

/// Records this agent's layout version in `pin_dir` (after loading).
pub fn write_version(pin_dir: &Path) -> Result<()> {
    let data = MapData::from_pin(pin_dir.join(MAP_LAYOUT)).with_context(|| format!("opening {MAP_LAYOUT}"))?;
    raw::update(data.fd().as_fd().as_raw_fd(), &0u32.to_ne_bytes(), &LAYOUT_VERSION.to_ne_bytes(), raw::ANY).with_context(|| format!("writing {MAP_LAYOUT}"))
}

/// Compares every pinned map with `want` (name -> definition, sizes as configured) and moves
/// the pins of maps that cannot be adopted aside, so the loader creates them anew. Call before
/// loading; then [`Migration::copy`] after loading and [`Migration::finish`] after attaching.
pub fn prepare(pin_dir: &Path, want: &HashMap<String, MapDef>) -> Result<Migration> {
    let from = pinned_version(pin_dir);
    let mut m = Migration { maps: Vec::new(), pin_dir: pin_dir.to_owned() };
    for (name, def) in want {
        let (pin, old) = (pin_dir.join(name), old_pin(pin_dir, name));
        // An earlier agent died half-way: its `_old` pin is the state to migrate from.
        let source = if pin.exists() {
            if old.exists() {
                fs::remove_file(&pin).with_context(|| format!("removing the half-migrated {}", pin.display()))?;
                old.clone()
            } else {
                pin.clone()
            }
        } else if old.exists() {
            old.clone()
        } else {
            continue;
        };
        let info = MapData::from_pin(&source).with_context(|| format!("opening {}", source.display()))?.info()?;
        let have = def_of(&info);
        let v = verdict(&have, def, changed_between(from, LAYOUT_VERSION, name));
        if v == Verdict::Adopt && source == pin {
            continue;
        }
        if source == pin {
            // bpffs has no rename: pin the same map a second time, then drop the first pin.
            MapData::from_pin(&pin)?.pin(&old).with_context(|| format!("pinning {} aside", pin.display()))?;
            fs::remove_file(&pin).with_context(|| format!("unpinning {}", pin.display()))?;
        }
        tracing::info!("pinned map {name}: {have:?} (layout {from}) -> {def:?} (layout {LAYOUT_VERSION}): {v:?}");
        m.maps.push((name.clone(), v));
    }
    m.maps.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(m)
}

impl Migration {
    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }

    /// Copies the entries of every `Copy` map from its old pin into the new map. `again`: only
    /// entries the new map does not have yet (those the old programs created meanwhile).
    /// Returns the entries copied.
    pub fn copy(&self, again: bool) -> Result<usize> {
        let mut n = 0;
        for (name, v) in &self.maps {
            if *v != Verdict::Copy {
                continue;
            }
            let old = MapData::from_pin(old_pin(&self.pin_dir, name))?;
            let new = MapData::from_pin(self.pin_dir.join(name))?;
            let info = old.info()?;
            let flags = if again { raw::NOEXIST } else { raw::ANY };
            let copied = raw::copy(old.fd().as_fd().as_raw_fd(), new.fd().as_fd().as_raw_fd(), info.key_size() as usize, info.value_size() as usize, flags)
                .with_context(|| format!("copying {name}"))?;
            tracing::info!("pinned map {name}: {copied} entries copied{}", if again { " (created during the switch)" } else { "" });
            n += copied;
        }
        Ok(n)
    }

    /// After the new programs are attached: copies what the old ones added meanwhile and
    /// removes the old pins (the old maps go with their last program).
    pub fn finish(self) -> Result<usize> {
        let n = self.copy(true)?;
        for (name, _) in &self.maps {
            let _ = fs::remove_file(old_pin(&self.pin_dir, name));
        }
        Ok(n)
    }
}

/// Byte-level map access (bpf(2)): copies entries between maps of any key and value type.
mod raw {
    use super::io;

    pub const ANY: u64 = 0;
    pub const NOEXIST: u64 = 1;
    const LOOKUP: libc::c_long = 1;
    const UPDATE: libc::c_long = 2;
    const GET_NEXT_KEY: libc::c_long = 4;

    fn elem(cmd: libc::c_long, fd: i32, key: Option<&[u8]>, value: *mut u8, flags: u64) -> io::Result<bool> {
        // bpf_attr for map element commands: map_fd, pad, key, value/next_key, flags.
        let mut attr = [0u64; 4];
        attr[0] = fd as u32 as u64;
        attr[1] = key.map_or(0, |k| k.as_ptr() as u64);
        attr[2] = value as u64;
        attr[3] = flags;
        // SAFETY: `attr` is laid out as the kernel's union for these commands; the buffers it
        // points to are valid for the map's key and value sizes (callers size them).
        let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), std::mem::size_of_val(&attr) as u32) };
        if r == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOENT) || (flags == NOEXIST && e.raw_os_error() == Some(libc::EEXIST)) {
            return Ok(false);
        }
        Err(e)
    }

    pub fn lookup(fd: i32, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
        elem(LOOKUP, fd, Some(key), value.as_mut_ptr(), 0)
    }

    pub fn update(fd: i32, key: &[u8], value: &[u8], flags: u64) -> io::Result<()> {
        elem(UPDATE, fd, Some(key), value.as_ptr().cast_mut(), flags).map(|_| ())
    }

    /// Copies every entry of `from` into `to` (same key and value sizes); entries that no
    /// longer fit (a smaller map) end the copy with an error.
    pub fn copy(from: i32, to: i32, key_size: usize, value_size: usize, flags: u64) -> io::Result<usize> {
        let (mut key, mut next, mut value) = (vec![0u8; key_size], vec![0u8; key_size], vec![0u8; value_size]);
        let mut first = true;
        let mut n = 0;
        loop {
            let more = elem(GET_NEXT_KEY, from, (!first).then_some(&key[..]), next.as_mut_ptr(), 0)?;
            if !more {
                return Ok(n);
            }
            first = false;
            std::mem::swap(&mut key, &mut next);
            // The entry may be gone (LRU eviction, deletion) between the two calls.
            if lookup(from, &key, &mut value)? && elem(UPDATE, to, Some(&key), value.as_mut_ptr(), flags)? {
                n += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(key: u32, value: u32, max: u32) -> MapDef {
        MapDef { map_type: 9, key_size: key, value_size: value, max_entries: max, flags: 0 }
    }

    #[test]
    fn verdicts() {
        assert_eq!(verdict(&def(16, 8, 4096), &def(16, 8, 4096), false), Verdict::Adopt);
        assert_eq!(verdict(&def(16, 8, 4096), &def(16, 8, 8192), false), Verdict::Copy, "capacity changed");
        assert_eq!(verdict(&def(16, 8, 4096), &MapDef { flags: 1, ..def(16, 8, 4096) }, false), Verdict::Copy, "flags changed");
        assert_eq!(verdict(&def(16, 8, 4096), &def(16, 12, 4096), false), Verdict::Recreate, "value layout changed");
        assert_eq!(verdict(&def(16, 8, 4096), &def(20, 8, 4096), false), Verdict::Recreate, "key layout changed");
        assert_eq!(verdict(&def(16, 8, 4096), &MapDef { map_type: 1, ..def(16, 8, 4096) }, false), Verdict::Recreate, "type changed");
        assert_eq!(verdict(&def(16, 8, 4096), &def(16, 8, 4096), true), Verdict::Recreate, "meaning changed");
    }

    #[test]
    fn changes_apply_from_the_version_after_the_pin_up_to_this_one() {
        assert!(!changed_between(0, LAYOUT_VERSION, "GN_CT4"), "no map changed meaning in version 1");
        assert!(!changed_between(LAYOUT_VERSION, LAYOUT_VERSION, "GN_CT4"));
    }
}
