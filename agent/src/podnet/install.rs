//! Files for the runtime, written so that a reader never sees half of one: a temporary file
//! in the same directory, then `rename`. A plugin binary being replaced keeps running from
//! its old inode.
use std::{
    fs,
    io::Write,
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

/// The binaries the conflist names: gardenet's plugin, the IPAM plugin it delegates to and
/// the chained portmap.
pub const PLUGINS: [&str; 3] = ["gardenet", "host-local", "portmap"];

/// Writes `bytes` to `path` (mode `mode`) unless it already holds them; `Ok(true)` when
/// it wrote.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<bool> {
    if fs::read(path).is_ok_and(|old| old == bytes) {
        return Ok(false);
    }
    let dir = path.parent().context("a path with a directory")?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".{}.gardenet-tmp", path.file_name().unwrap_or_default().to_string_lossy()));
    let result = (|| -> Result<()> {
        let mut f = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
        f.write_all(bytes)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.with_context(|| format!("writing {}", path.display()))?;
    Ok(true)
}

/// Where each plugin is taken from: the first of `from` that has it.
pub fn find_sources(from: &[PathBuf]) -> Result<Vec<(&'static str, PathBuf)>> {
    PLUGINS
        .iter()
        .map(|name| {
            from.iter()
                .map(|d| d.join(name))
                .find(|p| p.is_file())
                .map(|p| (*name, p))
                .with_context(|| format!("CNI plugin {name} not found in {}", from.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")))
        })
        .collect()
}

/// Copies the plugins into `bin_dir`; the names of those that changed.
pub fn install_plugins(from: &[PathBuf], bin_dir: &Path) -> Result<Vec<&'static str>> {
    let mut changed = Vec::new();
    for (name, src) in find_sources(from)? {
        let bytes = fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
        if write_atomic(&bin_dir.join(name), &bytes, 0o755)? {
            changed.push(name);
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gn-podnet-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn writes_only_what_changed_and_leaves_no_temporary_file() {
        let d = tmp("write");
        let f = d.join("net.d/10-gardenet.conflist");
        assert!(write_atomic(&f, b"one", 0o644).unwrap());
        assert!(!write_atomic(&f, b"one", 0o644).unwrap());
        assert!(write_atomic(&f, b"two", 0o644).unwrap());
        assert_eq!(fs::read(&f).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(f.parent().unwrap()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn plugins_come_from_the_first_directory_that_has_them() {
        let d = tmp("plugins");
        let (a, b, bin) = (d.join("a"), d.join("b"), d.join("bin"));
        fs::create_dir_all(&a).unwrap();
        fs::create_dir_all(&b).unwrap();
        fs::write(a.join("gardenet"), "g").unwrap();
        fs::write(b.join("gardenet"), "old").unwrap();
        fs::write(b.join("host-local"), "h").unwrap();
        let e = install_plugins(&[a.clone(), b.clone()], &bin).unwrap_err();
        assert!(e.to_string().contains("portmap"), "{e}");
        fs::write(b.join("portmap"), "p").unwrap();
        assert_eq!(install_plugins(&[a.clone(), b.clone()], &bin).unwrap(), PLUGINS.to_vec());
        assert_eq!(fs::read(bin.join("gardenet")).unwrap(), b"g");
        assert_eq!(fs::metadata(bin.join("portmap")).unwrap().permissions().mode() & 0o777, 0o755);
        assert!(install_plugins(&[a, b], &bin).unwrap().is_empty());
        fs::remove_dir_all(&d).unwrap();
    }
}
