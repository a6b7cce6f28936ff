#!/usr/bin/env bash
# distopt as a library other projects use: install into a temporary prefix,
# then build and run programs of one's own against it -- the example with
# find_package(distopt), the static target and the mpi component, and a
# pkg-config build -- and check that the shared library exports only the
# distopt namespace.
set -u
build=$1
src=$2
mpiexec=${3:-}
source "$(dirname "$0")/check_lib.sh"
prefix=$tmp/prefix

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 || fail "cmake --install: $(tail -n 3 "$tmp/install.log")"
for f in include/distopt/version.hpp include/distopt/parallel/strategy.hpp lib/libdistopt.a lib/libdistopt.so \
         lib/cmake/distopt/distoptConfig.cmake lib/cmake/distopt/distoptConfigVersion.cmake \
         lib/pkgconfig/distopt.pc bin/distopt share/doc/distopt/copyright share/doc/distopt/CHANGELOG.md \
         share/doc/distopt/docs/sharding.md; do
  [ -e "$prefix/$f" ] || fail "not installed: $f"
done
[ ! -e "$prefix/include/distopt/bench" ] || fail "the tool's private bench headers were installed"
version=$(sed -n 's/^#define DISTOPT_VERSION_STRING "\(.*\)"$/\1/p' "$prefix/include/distopt/version.hpp")
[ -n "$version" ] || fail "version.hpp has no DISTOPT_VERSION_STRING"
soname=$(objdump -p "$prefix/lib/libdistopt.so" | awk '/SONAME/ {print $2}')
[ "$soname" = "libdistopt.so.${version%.*}" ] || fail "SONAME $soname for version $version"
"$prefix/bin/distopt" --version | grep -q "^distopt $version (git .*; backends: threads" ||
  fail "distopt --version: $("$prefix/bin/distopt" --version)"

# Only the distopt namespace is exported (no Eigen, nlohmann-json or std instantiations).
others=$(nm -D --defined-only "$prefix/lib/libdistopt.so" | awk '{print $3}' | c++filt |
         grep -v -e '^distopt::' -e '^\(typeinfo\|typeinfo name\|vtable\|VTT\|guard variable\) for distopt::' \
                 -e 'thunk to distopt::' -e '^DISTOPT_0$' | head -n 5)
[ -z "$others" ] || fail "libdistopt.so exports symbols outside distopt: $others"

# The example, with find_package(distopt) against the installed tree.
cmake -S "$src/examples/train_mlp" -B "$tmp/example" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
  >"$tmp/log" 2>&1 || fail "configuring examples/train_mlp: $(tail -n 5 "$tmp/log")"
cmake --build "$tmp/example" >"$tmp/log" 2>&1 || fail "building examples/train_mlp: $(tail -n 5 "$tmp/log")"
"$tmp/example/train_mlp" >"$tmp/out" 2>"$tmp/err" || fail "train_mlp exited $?: $(cat "$tmp/out" "$tmp/err" | tail -n 3)"
/usr/bin/env python3 - "$tmp/out" "$version" <<'PY' || fail "train_mlp output: $(cat "$tmp/out")"
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert r["version"] == sys.argv[2], r
assert r["test_accuracy"] > 0.35, r  # chance: 0.1
assert len(r["param_hash"]) == 16, r
PY
ldd "$tmp/example/train_mlp" | grep -q "$prefix/lib/libdistopt.so" || fail "train_mlp does not use the installed libdistopt.so"

# The static target and the mpi component, in a project of their own.
mkdir -p "$tmp/consumer"
cat >"$tmp/consumer/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.20)
project(consumer LANGUAGES CXX)
find_package(distopt MINOR REQUIRED COMPONENTS mpi)
add_executable(uses_static uses_static.cpp)
target_link_libraries(uses_static PRIVATE distopt::distopt_static)
add_executable(uses_mpi uses_mpi.cpp)
target_link_libraries(uses_mpi PRIVATE distopt::mpi)
CM
cat >"$tmp/consumer/uses_static.cpp" <<'CPP'
#include <cstdio>
#include "distopt/core/error.hpp"
#include "distopt/optim/optimizer.hpp"
#include "distopt/version.hpp"
int main() {
  float w[3] = {1, 2, 3}, g[3] = {1, 1, 1};
  distopt::Param p{"w", {w, distopt::DType::f32, {3}}, {g, distopt::DType::f32, {3}}, true};
  distopt::Optimizer opt("sgd", std::vector<distopt::Param>{p}, {{"lr", 0.5}});
  opt.step();
  try {
    distopt::Optimizer bad("adamm", std::vector<distopt::Param>{p});
  } catch (const distopt::InvalidInput&) {  // type information crosses the library boundary
    std::printf("%s %g %g %g\n", DISTOPT_VERSION_STRING, w[0], w[1], w[2]);
    return 0;
  }
  return 1;
}
CPP
cat >"$tmp/consumer/uses_mpi.cpp" <<'CPP'
#include <cstdio>
#include "distopt/comm/mpi.hpp"
int main(int argc, char** argv) {
  distopt::MpiEnvironment env(&argc, &argv);
  auto comm = distopt::make_mpi_world();
  double x = comm->rank() + 1.0;
  comm->all_reduce(&x, &x, 1, distopt::ElemType::f64, distopt::ReduceOp::sum);
  if (comm->rank() == 0) std::printf("sum %g over %d ranks\n", x, comm->size());
  return 0;
}
CPP
sed -i "s/MINOR/${version%.*}/" "$tmp/consumer/CMakeLists.txt"
cmake -S "$tmp/consumer" -B "$tmp/consumer/build" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/log" 2>&1 ||
  fail "find_package(distopt ${version%.*} COMPONENTS mpi): $(grep -m 3 -i error -A 3 "$tmp/log")"
cmake --build "$tmp/consumer/build" >"$tmp/log" 2>&1 || fail "building the consumer: $(grep -m 5 -i error "$tmp/log")"
[ "$("$tmp/consumer/build/uses_static")" = "$version 0.5 1.5 2.5" ] ||
  fail "uses_static: $("$tmp/consumer/build/uses_static")"
ldd "$tmp/consumer/build/uses_static" | grep -q libdistopt && fail "uses_static links libdistopt.so, not the archive"
# While 0.x a minor version may break the API: a project asking for the
# previous one (0.(m-1)) does not get this one.
minor=${version#*.}; minor=${minor%%.*}
if [ "${version%%.*}" = 0 ] && [ "$minor" -gt 0 ]; then
  mkdir -p "$tmp/old"
  printf 'cmake_minimum_required(VERSION 3.20)\nproject(old LANGUAGES CXX)\nfind_package(distopt 0.%s REQUIRED)\n' \
    "$((minor - 1))" >"$tmp/old/CMakeLists.txt"
  cmake -S "$tmp/old" -B "$tmp/old/build" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/log" 2>&1 &&
    fail "find_package(distopt 0.$((minor - 1))) accepted $version"
  grep -q "distoptConfig.cmake, version: $version" "$tmp/log" ||
    fail "find_package(distopt 0.$((minor - 1))): $(grep -m 3 -i error -A 3 "$tmp/log")"
fi

if [ -n "$mpiexec" ]; then
  out=$(timeout 60 "$mpiexec" -n 2 --oversubscribe "$tmp/consumer/build/uses_mpi" 2>&1)
  [ "$out" = "sum 3 over 2 ranks" ] || fail "uses_mpi under mpirun: $out"
fi
# A version the installed one cannot satisfy is refused.
sed -i "s/find_package(distopt ${version%.*} REQUIRED/find_package(distopt 1.0 REQUIRED/" "$tmp/consumer/CMakeLists.txt"
cmake -S "$tmp/consumer" -B "$tmp/consumer/build1" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/log" 2>&1 &&
  fail "find_package(distopt 1.0) accepted version $version"

# pkg-config.
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
[ "$(pkg-config --modversion distopt)" = "$version" ] || fail "pkg-config --modversion distopt"
g++ -std=c++20 -o "$tmp/uses_pc" "$tmp/consumer/uses_static.cpp" $(pkg-config --cflags --libs distopt) 2>"$tmp/log" ||
  fail "g++ with pkg-config: $(head -n 3 "$tmp/log")"
[ "$(LD_LIBRARY_PATH=$prefix/lib "$tmp/uses_pc")" = "$version 0.5 1.5 2.5" ] || fail "the pkg-config build"
finish "package install"
