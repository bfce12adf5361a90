/* size.c - sizes written for people ("512MiB", "1.5 GB"), read exactly:
 * the one parser behind the command's --capacity and the connector's
 * sizes (api/common.c makes it public as ecx_size_parse). */
#include "core.h"

#include <ctype.h>
#include <string.h>
#include <strings.h>

/* The units, each with its multiplier; matched ignoring case. */
static const struct {
	const char *name;
	uint64_t mult;
} size_units[] = {
    {"", 1},
    {"B", 1},
    {"K", (uint64_t)1 << 10},
    {"KiB", (uint64_t)1 << 10},
    {"M", (uint64_t)1 << 20},
    {"MiB", (uint64_t)1 << 20},
    {"G", (uint64_t)1 << 30},
    {"GiB", (uint64_t)1 << 30},
    {"T", (uint64_t)1 << 40},
    {"TiB", (uint64_t)1 << 40},
    {"KB", 1000u},
    {"MB", 1000000u},
    {"GB", 1000000000u},
    {"TB", 1000000000000u},
};

/* What every refusal says, so that a reader learns the units. */
#define SIZE_UNITS_HELP                                                       \
	"write bytes, or a number with a unit: B; KiB, MiB, GiB, TiB (or K, " \
	"M, G, T), powers of 1024; KB, MB, GB, TB, powers of 1000 (e.g. "     \
	"512MiB, 1.5GB)"

/* Digits kept of a number: more is no size a host holds. */
#define SIZE_DIGITS_MAX 40

int core_size_parse(const char *s, uint64_t *out, char *why, size_t whylen)
{
	if (s == NULL || out == NULL)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "no size given: " SIZE_UNITS_HELP);
	const char *p = s;
	while (*p == ' ' || *p == '\t')
		p++;
	/* The number: its significant digits, and how many of them come
	 * before the point (leading zeros of the whole part dropped). */
	char digits[SIZE_DIGITS_MAX];
	size_t nd = 0, nwhole = 0;
	bool any = false, dot = false;
	for (;; p++) {
		if (*p == '.' && !dot) {
			dot = true;
			continue;
		}
		if (!isdigit((unsigned char)*p))
			break;
		any = true;
		if (!dot && nd == 0 && *p == '0')
			continue;
		if (nd == sizeof(digits))
			return ecx_why(why, whylen, ECX_EINVAL,
			               "'%.64s' has too many digits for a size",
			               s);
		digits[nd++] = *p;
		if (!dot)
			nwhole++;
	}
	/* An exponent moves the point right: "2e9". */
	if ((*p == 'e' || *p == 'E') && isdigit((unsigned char)p[1]) && any) {
		size_t e = 0; /* held at 1000: far past any size */
		for (p++; isdigit((unsigned char)*p); p++)
			if (e < 1000)
				e = e * 10 + (size_t)(*p - '0');
		nwhole += e;
	}
	while (*p == ' ' || *p == '\t')
		p++;
	size_t ul = strcspn(p, " \t");
	const char *rest = p + ul;
	while (*rest == ' ' || *rest == '\t')
		rest++;
	uint64_t mult = 0;
	for (size_t i = 0; i < sizeof(size_units) / sizeof(size_units[0]); i++)
		if (strlen(size_units[i].name) == ul &&
		    strncasecmp(p, size_units[i].name, ul) == 0)
			mult = size_units[i].mult;
	if (!any || mult == 0 || *rest != '\0')
		return ecx_why(why, whylen, ECX_EINVAL,
		               "'%.64s' is not a size: " SIZE_UNITS_HELP, s);
	/* The whole part times the unit, then the fraction's share of the
	 * unit, rounded down: floor(0.d1..dn * mult) digit by digit from the
	 * last (floor((floor(a / 10) + b) / 10) is floor((a + 10 b) / 100)),
	 * so that "4.35KB" is 4350 bytes, not a double's 4349. */
	uint64_t whole = 0;
	for (size_t i = 0; i < nwhole; i++) {
		whole = whole * 10 + (uint64_t)(i < nd ? digits[i] - '0' : 0);
		if (whole >= ECX_JSON_INT_MAX)
			break;
	}
	uint64_t frac = 0;
	for (size_t i = nd; i > nwhole; i--)
		frac = (frac + (uint64_t)(digits[i - 1] - '0') * mult) / 10;
	if (whole >= ECX_JSON_INT_MAX ||
	    whole > (ECX_JSON_INT_MAX - 1) / mult ||
	    whole * mult + frac >= ECX_JSON_INT_MAX)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "'%.64s' is too large: sizes stop below 2^53 "
		               "bytes (8 PiB)",
		               s);
	*out = whole * mult + frac;
	return 0;
}
