#!/bin/sh
# api-boundary.sh HEADER OBJDIR - checks that every public function (each
# ECX_API declaration in HEADER) is defined in an object of OBJDIR/api/
# and in no other: the public boundary is src/api/ alone.
#
#   scripts/api-boundary.sh include/ecx/ecx.h build/CMakeFiles/ecx_objects.dir/src
#
# Reads the objects' symbols with nm. An object whose dependency file
# (OBJ.d) names a source that is gone is skipped (left behind by a move).
# Exit status: 0 when it holds, 1 when a function is defined elsewhere or
# nowhere, 2 usage.
set -eu
if [ $# -ne 2 ] || [ ! -f "$1" ] || [ ! -d "$2" ]; then
	echo "usage: $0 HEADER OBJDIR" >&2
	exit 2
fi
header=$1
objdir=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The names declared ECX_API: the word before the first '(' on the line.
sed -n 's/^ECX_API[^(]*[ *]\([a-z_0-9]*\)(.*/\1/p' "$header" | sort -u \
	>"$tmp/public"
if [ ! -s "$tmp/public" ]; then
	echo "api-boundary: no ECX_API declaration in $header" >&2
	exit 2
fi

# Each defined text symbol with the object (path under objdir) it is in.
find "$objdir" -name '*.o' | sort | while read -r obj; do
	if [ -f "$obj.d" ]; then
		src=$(sed -n '1s/^[^:]*: *\([^ \\]*\).*/\1/p' "$obj.d")
		if [ -n "$src" ] && [ ! -e "$src" ]; then
			echo "api-boundary: skipped $obj: its source $src is gone" >&2
			continue
		fi
	fi
	rel=${obj#"$objdir"/}
	nm -P --defined-only "$obj" |
		awk -v o="${rel%.o}" '$2 == "T" || $2 == "W" { print $1, o }'
done | sort >"$tmp/defined"

bad=0
while read -r name; do
	where=$(awk -v n="$name" '$1 == n { print $2 }' "$tmp/defined")
	if [ -z "$where" ]; then
		echo "api-boundary: $name is declared ECX_API but defined nowhere"
		bad=1
		continue
	fi
	for w in $where; do
		case $w in
		api/*) ;;
		*)
			echo "api-boundary: $name is defined in $w, outside api/"
			bad=1
			;;
		esac
	done
done <"$tmp/public"
if [ $bad -eq 0 ]; then
	echo "every one of $(wc -l <"$tmp/public") public functions is defined in api/"
fi
exit $bad
