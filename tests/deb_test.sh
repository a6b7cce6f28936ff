#!/usr/bin/env bash
# The Debian package: built with CPack, its control fields and contents
# checked with dpkg-deb, then unpacked (dpkg-deb -x, no root needed) and
# used: the tool runs a short training, and find_package finds the
# unpacked CMake package. (Installing with dpkg -i would need a clean
# machine; CI does not have one.)
set -u
build=$1
source "$(dirname "$0")/check_lib.sh"
cpack --config "$build/CPackConfig.cmake" -B "$tmp/pkg" >"$tmp/log" 2>&1 || fail "cpack: $(tail -n 5 "$tmp/log")"
deb=$(ls "$tmp"/pkg/distopt_*.deb 2>/dev/null | head -n 1)
[ -n "$deb" ] || fail "cpack wrote no distopt_*.deb: $(ls "$tmp/pkg")"
version=$(sed -n 's/^#define DISTOPT_VERSION_STRING "\(.*\)"$/\1/p' "$build/include/distopt/version.hpp")
dpkg-deb --info "$deb" >"$tmp/info" || fail "dpkg-deb --info"
grep -q "^ Package: distopt$" "$tmp/info" || fail "package name: $(grep Package "$tmp/info")"
grep -q "^ Version: $version$" "$tmp/info" || fail "version: $(grep Version "$tmp/info")"
depends=$(grep "^ Depends:" "$tmp/info")
for d in libc6 libstdc++6 zlib1g libxxhash0 libopenmpi3; do
  echo "$depends" | grep -q "\b$d\b" || fail "Depends lacks $d: $depends"
done
dpkg-deb --contents "$deb" >"$tmp/contents" || fail "dpkg-deb --contents"
for f in ./usr/bin/distopt ./usr/lib/libdistopt.so.$version ./usr/lib/libdistopt.a ./usr/include/distopt/version.hpp \
         ./usr/lib/cmake/distopt/distoptConfig.cmake ./usr/lib/pkgconfig/distopt.pc ./usr/share/doc/distopt/copyright; do
  grep -q " $f\( \|$\)" "$tmp/contents" || fail "the package lacks $f"
done
# The Python package in Debian's layout, where Debian's interpreter looks.
if [ -f "$build/python/distopt/__init__.py" ]; then
  grep -q " ./usr/lib/python3/dist-packages/distopt/_core\.cpython" "$tmp/contents" ||
    fail "the package lacks distopt/_core in /usr/lib/python3/dist-packages: $(grep -m 3 python "$tmp/contents")"
fi
dpkg-deb -x "$deb" "$tmp/root" || fail "dpkg-deb -x"
"$tmp/root/usr/bin/distopt" --version | grep -q "^distopt $version " || fail "unpacked distopt --version"
"$tmp/root/usr/bin/distopt" train --data synthetic --train-size 512 --test-size 128 --world 2 --strategy zero2 --json \
  --progress none >"$tmp/out" 2>"$tmp/err" || fail "unpacked distopt train: $(tail -n 2 "$tmp/err")"
grep -q '"param_hash"' "$tmp/out" || fail "unpacked distopt train printed no summary"
mkdir -p "$tmp/consumer"
printf 'cmake_minimum_required(VERSION 3.20)\nproject(c LANGUAGES CXX)\nfind_package(distopt %s REQUIRED)\nmessage(STATUS "distopt_DIR=${distopt_DIR}")\n' \
  "$version" >"$tmp/consumer/CMakeLists.txt"
cmake -S "$tmp/consumer" -B "$tmp/consumer/build" -DCMAKE_PREFIX_PATH="$tmp/root/usr" >"$tmp/log" 2>&1 ||
  fail "find_package in the unpacked package: $(grep -m 3 -i error -A 3 "$tmp/log")"
finish "debian package"
