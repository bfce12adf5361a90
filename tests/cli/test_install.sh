#!/bin/sh
# make install's result works: installs the build into a scratch prefix,
# then builds a program against it with pkg-config, shared and static.
# Usage: test_install.sh BUILD_DIR
set -u
build=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
check() {
	name=$1
	shift
	if "$@" >"$tmp/log" 2>&1; then
		echo "ok - $name"
		pass=$((pass + 1))
	else
		echo "FAIL - $name"
		cat "$tmp/log"
		fail=$((fail + 1))
	fi
}
check "cmake --install" cmake --install "$build" --prefix "$tmp/p"
for f in include/ecx/ecx.h bin/ecx; do
	check "installs $f" test -e "$tmp/p/$f"
done
libdir=$(dirname "$(find "$tmp/p" -name ecx.pc)")/..
check "installs libecx.so" test -e "$libdir/libecx.so"
check "installs libecx.a" test -e "$libdir/libecx.a"
cat >"$tmp/use.c" <<'C'
#include <ecx/ecx.h>
#include <stdio.h>
#include <string.h>
int main(void)
{
	if (strcmp(ecx_version(), ECX_VERSION_STRING) != 0)
		return 1;
	return ecx_id_check("lora:abc", NULL, 0) == 0 &&
	               ecx_id_check("a/b", NULL, 0) == ECX_EID
	           ? 0
	           : 1;
}
C
export PKG_CONFIG_PATH="$libdir/pkgconfig"
check "a program builds with pkg-config" \
	sh -c "cc '$tmp/use.c' -o '$tmp/use' \$(pkg-config --cflags --libs ecx)"
check "and runs" env LD_LIBRARY_PATH="$libdir" "$tmp/use"
# libecx.a with its dependencies' shared libraries (Requires.private).
deps=$(sed -n 's/^Requires.private: //p' "$libdir/pkgconfig/ecx.pc")
check "libecx.a links (dependencies from Requires.private)" \
	sh -c "cc '$tmp/use.c' -o '$tmp/use-a' \$(pkg-config --cflags ecx) '$libdir/libecx.a' \$(pkg-config --libs $deps) -lpthread -lm"
check "and runs without libecx.so" "$tmp/use-a"
check "only ecx_ symbols are exported" \
	sh -c "! nm -D --defined-only '$libdir/libecx.so' | awk '{print \$3}' | grep -v '^ecx_' | grep -v '^_'"
# The public registry client, the entry codecs and the two-step put are
# exported.
for sym in ecx_client_create ecx_client_destroy ecx_client_lookup \
	ecx_client_publish ecx_client_remove ecx_client_list \
	ecx_client_health ecx_client_connections ecx_item_to_json \
	ecx_item_from_json ecx_free ecx_producer_reserve ecx_producer_commit \
	ecx_producer_cancel ecx_producer_arena ecx_consumer_arena; do
	check "exports $sym" \
		sh -c "nm -D --defined-only '$libdir/libecx.so' | awk '{print \$3}' | grep -qx '$sym'"
done
# The command links the shared library and finds the installed one by
# itself (its RPATH is $ORIGIN/../LIBDIR), not the build tree's.
found=$(ldd "$tmp/p/bin/ecx" | awk '$1 == "libecx.so.0" {print $3}')
check "bin/ecx links the installed libecx.so.0" \
	test "$(readlink -f "$found")" = "$(readlink -f "$libdir/libecx.so.0")"
check "and runs from the install" sh -c "'$tmp/p/bin/ecx' version | grep -q '^ecx '"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
