#!/bin/bash
# rdmavm.sh - boot a throw-away QEMU VM (TCG, no KVM) with Soft-RoCE (rdma_rxe) and run real
# libibverbs programs in it: gpudirect's rdma_* test binaries, its rdma-write-bw example and
# perftest's ib_write_bw. Recipe and every pitfall: shared/reference/rdma-vm.md.
#
# Everything the guest runs comes from Debian packages fetched with `apt-get download` into
# $W/debs (cached) and unpacked with dpkg -x (never installed), plus the host's glibc (our
# binaries are linked against it) and the binaries named in BINS.
#
#   W=dir            work/cache directory (default: vm/work next to this script; git-ignored)
#   BINS="a b ..."   extra host binaries to put in the guest's /bin (test binaries, examples)
#   TESTS="a b ..."  basenames (in BINS) of libtest binaries run by `run tests` / `pair`
#   VM_TIMEOUT=s     qemu wall-clock limit per VM (default 300)
#
#   vm/rdmavm.sh setup            host tools (qemu, kmod, cpio; apt-get install when root),
#                                 .debs into $W/debs, kernel unpacked, vmlinux extracted
#   vm/rdmavm.sh build            initramfs with busybox, rdma-core 44, perftest, iproute2, rxe
#                                 modules and $BINS
#   vm/rdmavm.sh run [MODE] [ARGS] one VM; MODE = tests (default: every TESTS binary with
#                                 `--include-ignored rdma_`), smoke (ibv_devinfo + ib_write_bw +
#                                 rping), bench (gpudirect rdma-write-bw vs ib_write_bw), shell
#   vm/rdmavm.sh pair             two VMs joined by a qemu socket netdev (RoCE v2 over a
#                                 virtual Ethernet): TESTS binaries with `rdma_pair_`,
#                                 rdma-write-bw server/client with --verify, ib_write_bw
# Exit status 0 iff every guest printed RDMAVM_RESULT=PASS. Serial logs: $W/vm*.log.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
W=${W:-$HERE/work}
VM_TIMEOUT=${VM_TIMEOUT:-300}
mkdir -p "$W"
W=$(cd "$W" && pwd)

# Guest packages (bookworm). Their shared libraries come from here too; glibc and libgcc_s come
# from the host because our own binaries were linked against the host's.
GUEST_PKGS="busybox-static libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils rdmacm-utils perftest
  iproute2 libnl-3-200 libnl-route-3-200 libmnl0 libbpf1 libelf1 libxtables12 libcap2 libbsd0 libmd0
  libdb5.3 libtirpc3 libselinux1 libpcre2-8-0 zlib1g libzstd1 libgssapi-krb5-2 libkrb5-3 libk5crypto3
  libkrb5support0 libcom-err2 libkeyutils1 libpci3 libudev1"

log() { echo "rdmavm: $*" >&2; }
die() { echo "rdmavm: error: $*" >&2; exit 1; }

need_host_tools() {
  local missing=()
  command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
  command -v depmod >/dev/null || missing+=(kmod)
  command -v cpio >/dev/null || missing+=(cpio)
  command -v xz >/dev/null || missing+=(xz-utils)
  command -v zstd >/dev/null || missing+=(zstd)
  command -v python3 >/dev/null || missing+=(python3-minimal)
  [ ${#missing[@]} = 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "missing host packages: ${missing[*]} (apt-get install them, or run as root)"
  log "installing host packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null ||
    { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
}

# apt-get download into $W/debs; on a stale package list, update once and retry
download() {
  mkdir -p "$W/debs"
  local want=()
  for p in "$@"; do ls "$W/debs/${p}"_*.deb >/dev/null 2>&1 || want+=("$p"); done
  [ ${#want[@]} = 0 ] && return 0
  log "apt-get download ${want[*]}"
  (cd "$W/debs" && apt-get download "${want[@]}" >/dev/null 2>"$W/apt.err") ||
    { log "retrying after apt-get update"; apt-get update >/dev/null &&
      (cd "$W/debs" && apt-get download "${want[@]}" >/dev/null 2>"$W/apt.err"); } ||
    { cat "$W/apt.err" >&2; die "apt-get download failed"; }
}

setup() {
  need_host_tools
  local kpkg
  kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  [ -n "$kpkg" ] || die "cannot resolve linux-image-amd64 (apt-get update?)"
  # shellcheck disable=SC2086
  download $GUEST_PKGS "$kpkg"
  if [ "$(cat "$W/sysroot/.done" 2>/dev/null)" != "$(echo $GUEST_PKGS)" ]; then
    rm -rf "$W/sysroot"; mkdir -p "$W/sysroot"
    for p in $GUEST_PKGS; do dpkg -x "$(ls -t "$W/debs/${p}"_*.deb | head -1)" "$W/sysroot"; done
    echo $GUEST_PKGS > "$W/sysroot/.done"
  fi
  if [ ! -f "$W/kroot/.done" ] || [ "$(cat "$W/kroot/.pkg")" != "$kpkg" ]; then
    log "unpacking $kpkg"
    rm -rf "$W/kroot"; mkdir -p "$W/kroot"
    dpkg -x "$(ls -t "$W/debs/${kpkg}"_*.deb | head -1)" "$W/kroot"
    echo "$kpkg" > "$W/kroot/.pkg"; touch "$W/kroot/.done"; rm -f "$W/vmlinux"
  fi
  local kver; kver=$(ls "$W/kroot/lib/modules"); echo "$kver" > "$W/kver"
  if [ ! -f "$W/vmlinux" ]; then
    # the uncompressed vmlinux boots through PVH and skips the xz decompressor (~4 s under TCG)
    python3 - "$W/kroot/boot/vmlinuz-$kver" "$W/vmlinux" <<'PY'
import lzma, subprocess, sys
data = open(sys.argv[1], 'rb').read()
i = data.find(b'\xfd7zXZ\x00')
if i >= 0:
    elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[i:])
else:
    i = data.find(b'\x28\xb5\x2f\xfd')
    elf = subprocess.run(['zstd', '-dc'], input=data[i:], stdout=subprocess.PIPE).stdout
assert elf[:4] == b'\x7fELF', 'could not extract vmlinux'
open(sys.argv[2], 'wb').write(elf)
PY
    depmod -b "$W/kroot" "$kver"
  fi
  log "setup done: kernel $kver, $(ls "$W/debs" | wc -l) packages cached in $W/debs"
}

build() {
  [ -f "$W/kver" ] || die "run setup first"
  local kver; kver=$(cat "$W/kver")
  local S="$W/sysroot" ML=x86_64-linux-gnu
  local STAGE; STAGE=$(mktemp -d "$W/stage.XXXXXX")
  trap 'rm -rf "$STAGE"' RETURN
  mkdir -p "$STAGE"/{bin,sbin,proc,sys,dev,tmp,run,lib/modules,lib64,etc/libibverbs.d,usr/lib/$ML/libibverbs}
  cp "$S/bin/busybox" "$STAGE/bin/"
  local bins="$S/usr/bin/ibv_devices $S/usr/bin/ibv_devinfo $S/usr/bin/ib_write_bw $S/usr/bin/rping
              $S/usr/bin/rdma $S/bin/ip"
  local b; for b in $bins; do [ -x "$b" ] || die "missing $b in the sysroot"; cp "$b" "$STAGE/bin/"; done
  for b in ${BINS:-}; do
    [ -x "$b" ] || die "BINS: $b is not an executable"
    # debug info is most of a Rust test binary; the guest needs none of it
    strip --strip-debug -o "$STAGE/bin/$(basename "$b")" "$b" 2>/dev/null || cp "$b" "$STAGE/bin/"
  done
  local prov="$S/usr/lib/$ML/libibverbs/librxe-rdmav34.so"
  cp "$prov" "$STAGE/usr/lib/$ML/libibverbs/"
  cp "$S/etc/libibverbs.d/rxe.driver" "$STAGE/etc/libibverbs.d/"
  # shared libraries: libibverbs/librdmacm are dlopen()ed by gpudirect and libgcc_s by glibc
  # (pthread_exit), so ldd cannot see them; everything else is what ldd resolves, preferring
  # the sysroot (Debian's rdma-core 44) and falling back to the host (glibc)
  local lp="$S/usr/lib/$ML:$S/lib/$ML"
  {
    for f in "$STAGE"/bin/* "$prov" "$S/usr/lib/$ML/libibverbs.so.1" "$S/usr/lib/$ML/librdmacm.so.1"; do
      [ "$(basename "$f")" = busybox ] && continue
      LD_LIBRARY_PATH=$lp ldd "$f" 2>/dev/null | awk -v f="$f" '/not found/{print "MISSING " $1 " (needed by " f ")"} /=> \//{print $3}'
    done
    echo "$S/usr/lib/$ML/libibverbs.so.1"; echo "$S/usr/lib/$ML/librdmacm.so.1"
    for d in /lib/$ML /usr/lib/$ML; do [ -e $d/libgcc_s.so.1 ] && { echo $d/libgcc_s.so.1; break; }; done
  } | sort -u > "$W/libs.txt"
  if grep -q '^MISSING' "$W/libs.txt"; then grep '^MISSING' "$W/libs.txt" >&2; die "unresolved shared libraries"; fi
  local lib; while read -r lib; do cp -L "$lib" "$STAGE/usr/lib/$ML/"; done < "$W/libs.txt"
  ln -s ../usr/lib/$ML "$STAGE/lib/$ML"
  cp -L /lib64/ld-linux-x86-64.so.2 "$STAGE/lib64/"
  # kernel modules in dependency order (no modprobe in the guest). crc32_generic first: rxe
  # asks the crypto API for "crc32" and nothing would autoload it (reference: pitfalls)
  : > "$STAGE/modules.order"
  local m; for m in crc32_generic crc32c_generic libcrc32c dummy ib_uverbs rdma_rxe rdma_ucm virtio_pci virtio_net; do
    modprobe -d "$W/kroot" -S "$kver" --show-depends "$m" | awk '$1=="insmod"{print $2}'
  done | awk '!seen[$0]++' | while read -r ko; do
    local base; base=$(basename "$ko"); base=${base%.xz}; base=${base%.zst}
    case "$ko" in *.xz) xz -dc "$ko";; *.zst) zstd -qdc "$ko";; *) cat "$ko";; esac > "$STAGE/lib/modules/$base"
    echo "$base" >> "$STAGE/modules.order"
  done
  install -m 755 "$HERE/init" "$STAGE/init"
  echo "${TESTS:-}" > "$STAGE/tests.list"
  (cd "$STAGE" && find . | cpio -o -H newc --quiet | gzip -1) > "$W/initramfs.cpio.gz"
  log "built $W/initramfs.cpio.gz ($(du -h "$W/initramfs.cpio.gz" | cut -f1)) for kernel $kver"
}

elapsed() { echo "$(date +%s.%N) $1" | awk '{printf "%.1f", $1 - $2}'; }

# one VM with rxe on a dummy netdev; both ends of every test inside it
run() {
  local mode=${1:-tests}; shift || true
  local log="$W/vm-$mode.log" t0; t0=$(date +%s.%N)
  [ -f "$W/initramfs.cpio.gz" ] || die "run build first"
  timeout "$VM_TIMEOUT" qemu-system-x86_64 -accel tcg -m 2G -smp 2 -nographic -no-reboot -nic none \
    -kernel "$W/vmlinux" -initrd "$W/initramfs.cpio.gz" \
    -append "console=ttyS0 panic=-1 loglevel=4 rdmanet=dummy rdmamode=$mode $*" > "$log" 2>&1 || true
  tr -d '\r' < "$log" | sed -n '/^\[t=/,$p' | grep -av '^RDMAVM_RESULT' || true
  log "VM ($mode) finished in $(elapsed "$t0") s: $(grep -a -o 'RDMAVM_RESULT=.*' "$log" | tr -d '\r' || echo "no result, see $log")"
  grep -a -q 'RDMAVM_RESULT=PASS' "$log"
}

# two VMs joined by a qemu socket netdev: RoCE v2 packets really cross a virtual Ethernet
# (loopback rxe short-circuits packets to its own MAC)
pair() {
  local common=(-accel tcg -m 1G -smp 1 -nographic -no-reboot -kernel "$W/vmlinux" -initrd "$W/initramfs.cpio.gz")
  local port=${PORT:-$((20000 + RANDOM % 20000))} t0; t0=$(date +%s.%N)
  timeout "$VM_TIMEOUT" qemu-system-x86_64 "${common[@]}" \
    -netdev socket,id=n0,listen=127.0.0.1:$port -device virtio-net-pci,netdev=n0,mac=52:54:00:77:00:01 \
    -append "console=ttyS0 panic=-1 loglevel=4 rdmanet=virtio rdmamode=pair rdmapair=server" > "$W/vm-server.log" 2>&1 &
  local s=$!
  sleep 1
  timeout "$VM_TIMEOUT" qemu-system-x86_64 "${common[@]}" \
    -netdev socket,id=n0,connect=127.0.0.1:$port -device virtio-net-pci,netdev=n0,mac=52:54:00:77:00:02 \
    -append "console=ttyS0 panic=-1 loglevel=4 rdmanet=virtio rdmamode=pair rdmapair=client" > "$W/vm-client.log" 2>&1 || true
  wait $s || true
  local f; for f in server client; do
    echo "----- $f VM -----"; tr -d '\r' < "$W/vm-$f.log" | sed -n '/^\[t=/,$p' | grep -av '^RDMAVM_RESULT' || true
  done
  log "two VMs finished in $(elapsed "$t0") s: server $(grep -a -o 'RDMAVM_RESULT=.*' "$W/vm-server.log" | tr -d '\r' || echo none), client $(grep -a -o 'RDMAVM_RESULT=.*' "$W/vm-client.log" | tr -d '\r' || echo none)"
  grep -a -q 'RDMAVM_RESULT=PASS' "$W/vm-server.log" && grep -a -q 'RDMAVM_RESULT=PASS' "$W/vm-client.log"
}

case "${1:-}" in
  setup) setup ;;
  build) build ;;
  run) shift; run "$@" ;;
  pair) pair ;;
  *) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
