/* gen.c - deterministic item bytes and realistic item shapes. */
#include "gen.h"

#include <string.h>

/* FNV-1a of the id: the bytes of every item ever generated depend on it,
 * so it must not change (tests and other processes compare them). */
static uint64_t gen_seed(const char *id)
{
	uint64_t h = 1469598103934665603ull;
	for (const char *s = id; *s != '\0'; s++)
		h = (h ^ (unsigned char)*s) * 1099511628211ull;
	return h | 1; /* xorshift needs a non-zero state */
}

/* xorshift64: fast enough that generating is not what a benchmark sees. */
void gen_fill(const char *id, void *buf, size_t n)
{
	uint64_t x = gen_seed(id);
	unsigned char *p = buf;
	size_t i = 0;
	for (; i + 8 <= n; i += 8) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		memcpy(p + i, &x, 8);
	}
	for (; i < n; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		p[i] = (unsigned char)x;
	}
}

bool gen_check(const char *id, const void *buf, size_t n)
{
	uint64_t x = gen_seed(id);
	const unsigned char *p = buf;
	size_t i = 0;
	for (; i + 8 <= n; i += 8) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		if (memcmp(p + i, &x, 8) != 0)
			return false;
	}
	for (; i < n; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		if (p[i] != (unsigned char)x)
			return false;
	}
	return true;
}

uint64_t gen_qwen_tokens(size_t i)
{
	/* 224x224, 448x448, 640x640, 1024x1024 images and a 1080p frame,
	 * weighted towards the small and middle sizes people upload. */
	static const uint64_t tokens[] = {64,   256, 529, 256, 529,
	                                  1369, 64,  529, 256, 2691};
	return tokens[i % (sizeof(tokens) / sizeof(tokens[0]))];
}
