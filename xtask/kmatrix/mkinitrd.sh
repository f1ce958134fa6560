#!/bin/bash
# mkinitrd.sh <kmx dir> <kernel release> <init> -> <kmx dir>/initrd/<release>.cpio.gz
# A ~2 MB initramfs: busybox and the module closure that reaching the host root needs
# (virtio, 9p, overlay); everything else loads from the kernel's own modules later.
set -euo pipefail
KM=$1; V=$2; INIT=$3; BB=$KM/tools/bin/busybox
KROOT=$KM/k/$V; MD=$KROOT/lib/modules/$V; [ -d "$MD" ] || MD=$KROOT/usr/lib/modules/$V
W=$(mktemp -d "$KM/initrd-work.XXXX"); trap 'rm -rf "$W"' EXIT
mkdir -p "$W"/{bin,proc,sys,dev,newroot,lower,upper,run} "$W/lib/modules/$V" "$KM/initrd"
cp "$BB" "$W/bin/busybox"; ln -s busybox "$W/bin/sh"
closure() { # module paths (relative to $MD) of a module and its dependencies
  local line; line=$(grep -E "(^|/)$1\.ko(\.xz|\.zst)?:" "$MD/modules.dep" || true)
  if [ -n "$line" ]; then echo "$line" | tr -d ':' | tr ' ' '\n' | grep . ; fi; return 0
}
for m in virtio_pci 9pnet_virtio 9p overlay; do closure $m; done | sort -u | while read -r rel; do
  mkdir -p "$W/lib/modules/$V/$(dirname "$rel")"
  case $rel in
    *.xz) xz -dc "$MD/$rel" > "$W/lib/modules/$V/${rel%.xz}";;
    *.zst) zstd -qdc "$MD/$rel" > "$W/lib/modules/$V/${rel%.zst}";;
    *) cp "$MD/$rel" "$W/lib/modules/$V/$rel";;
  esac
done
sed -e 's/\.ko\.xz/.ko/g' -e 's/\.ko\.zst/.ko/g' "$MD/modules.dep" > "$W/lib/modules/$V/modules.dep"
cp "$MD/modules.builtin" "$W/lib/modules/$V/" 2>/dev/null || true
cp "$INIT" "$W/init"; chmod +x "$W/init"
(cd "$W" && find . | "$BB" cpio -o -H newc 2>/dev/null | gzip -1) > "$KM/initrd/$V.cpio.gz.tmp"
mv "$KM/initrd/$V.cpio.gz.tmp" "$KM/initrd/$V.cpio.gz"
