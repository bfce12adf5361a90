/* jstream.c - JSON without a tree: the direct writer and the checked
 * reader of jstream.h. */
#include "wire/jstream.h"
#include "wire/wire.h"

#include <stdlib.h>
#include <string.h>

/* ---- writer ---- */

bool js_reserve(js_out *o, size_t n)
{
	if (o->failed)
		return false;
	if (o->len + n + 1 <= o->cap)
		return true;
	size_t cap = o->cap > 0 ? o->cap * 2 : 256;
	while (cap < o->len + n + 1)
		cap *= 2;
	char *p = realloc(o->p, cap);
	if (p == NULL) {
		o->failed = true;
		return false;
	}
	o->p = p;
	o->cap = cap;
	return true;
}

void js_raw(js_out *o, const char *s, size_t n)
{
	if (!js_reserve(o, n))
		return;
	memcpy(o->p + o->len, s, n);
	o->len += n;
}

/* The first byte in [p, e) that is a '"', a '\\' or below 0x20 (e when
 * none), eight bytes at a time: in each word, a byte's high bit flags one
 * below 0x20 or equal to either (exact for the lowest flagged byte, which
 * is the first in memory on a little-endian machine). */
static const char *plain_run(const char *p, const char *e)
{
	const uint64_t ones = 0x0101010101010101ull, high = ones << 7;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	while (e - p >= 8) {
		uint64_t v, q, b;
		memcpy(&v, p, 8);
		q = v ^ (ones * '"');
		b = v ^ (ones * '\\');
		uint64_t hit = ((v - ones * 0x20) & ~v) | ((q - ones) & ~q) |
		               ((b - ones) & ~b);
		hit &= high;
		if (hit != 0)
			return p + __builtin_ctzll(hit) / 8;
		p += 8;
	}
#endif
	while (p < e && (unsigned char)*p >= 0x20 && *p != '"' && *p != '\\')
		p++;
	return p;
}

void js_str(js_out *o, const char *s)
{
	if (s == NULL)
		s = "";
	size_t n = strlen(s);
	if (!js_reserve(o, 6 * n + 2))
		return;
	char *w = o->p + o->len;
	const char *e = s + n;
	*w++ = '"';
	while (s < e) {
		const char *q = plain_run(s, e);
		memcpy(w, s, (size_t)(q - s));
		w += q - s;
		if (q == e)
			break;
		unsigned char c = (unsigned char)*q;
		s = q + 1;
		*w++ = '\\';
		switch (c) {
		case '"':
		case '\\':
			*w++ = (char)c;
			break;
		case '\b':
			*w++ = 'b';
			break;
		case '\f':
			*w++ = 'f';
			break;
		case '\n':
			*w++ = 'n';
			break;
		case '\r':
			*w++ = 'r';
			break;
		case '\t':
			*w++ = 't';
			break;
		default: {
			static const char hex[] = "0123456789abcdef";
			*w++ = 'u';
			*w++ = '0';
			*w++ = '0';
			*w++ = hex[c >> 4];
			*w++ = hex[c & 15];
		}
		}
	}
	*w++ = '"';
	o->len = (size_t)(w - o->p);
}

void js_u64(js_out *o, uint64_t v)
{
	char d[20];
	size_t k = sizeof(d);
	do {
		d[--k] = (char)('0' + v % 10);
		v /= 10;
	} while (v != 0);
	js_raw(o, d + k, sizeof(d) - k);
}

char *js_done(js_out *o)
{
	if (!js_reserve(o, 0)) {
		free(o->p);
		o->p = NULL;
		return NULL;
	}
	o->p[o->len] = '\0';
	char *p = o->p;
	o->p = NULL;
	o->len = o->cap = 0;
	return p;
}

/* ---- checking ---- */

static bool js_ws(char c)
{
	return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

static const char *skip_ws(const char *p, const char *e)
{
	while (p < e && js_ws(*p))
		p++;
	return p;
}

static bool is_digit(char c)
{
	return c >= '0' && c <= '9';
}

/* The four hex digits at q (q + 4 <= e is checked); -1 when not hex. */
static long hex4(const char *q, const char *e)
{
	if (e - q < 4)
		return -1;
	long v = 0;
	for (int i = 0; i < 4; i++) {
		int h = ecx_hex_digit(q[i]);
		if (h < 0)
			return -1;
		v = v << 4 | h;
	}
	return v;
}

/* Checks the string opening at p (a '"'); the byte after its closing quote,
 * or NULL. Escapes as cJSON reads them: a surrogate pair must be whole. */
static const char *chk_string(const char *p, const char *e)
{
	for (p++; p < e;) {
		unsigned char c = (unsigned char)*p;
		if (c == '"')
			return p + 1;
		if (c < 0x20)
			return NULL;
		if (c != '\\') {
			p = plain_run(p + 1, e);
			continue;
		}
		if (e - p < 2)
			return NULL;
		switch (p[1]) {
		case '"':
		case '\\':
		case '/':
		case 'b':
		case 'f':
		case 'n':
		case 'r':
		case 't':
			p += 2;
			break;
		case 'u': {
			long u = hex4(p + 2, e);
			if (u <= 0 || (u >= 0xDC00 && u <= 0xDFFF))
				return NULL;
			if (u >= 0xD800 && u <= 0xDBFF) {
				long l =
				    e - p >= 12 && p[6] == '\\' && p[7] == 'u'
				        ? hex4(p + 8, e)
				        : -1;
				if (l < 0xDC00 || l > 0xDFFF)
					return NULL;
				p += 12;
			} else {
				p += 6;
			}
			break;
		}
		default:
			return NULL;
		}
	}
	return NULL;
}

/* Checks an RFC 8259 number at p; the byte after it, or NULL. */
static const char *chk_number(const char *p, const char *e)
{
	if (p < e && *p == '-')
		p++;
	if (p >= e || !is_digit(*p))
		return NULL;
	if (*p++ != '0')
		while (p < e && is_digit(*p))
			p++;
	if (p < e && *p == '.') {
		if (++p >= e || !is_digit(*p))
			return NULL;
		while (p < e && is_digit(*p))
			p++;
	}
	if (p < e && (*p == 'e' || *p == 'E')) {
		p++;
		if (p < e && (*p == '+' || *p == '-'))
			p++;
		if (p >= e || !is_digit(*p))
			return NULL;
		while (p < e && is_digit(*p))
			p++;
	}
	return p;
}

static const char *chk_lit(const char *p, const char *e, const char *lit)
{
	size_t n = strlen(lit);
	return (size_t)(e - p) >= n && memcmp(p, lit, n) == 0 ? p + n : NULL;
}

/* Checks one value at p (after whitespace); the byte after it, or NULL.
 * Iterative, with the closing bracket of each open container on a stack. */
static const char *chk_value(const char *p, const char *e)
{
	char close[JS_DEPTH];
	int d = 0;
value:
	p = skip_ws(p, e);
	if (p >= e)
		return NULL;
	switch (*p) {
	case '{':
	case '[':
		if (d == JS_DEPTH)
			return NULL;
		close[d++] = *p == '{' ? '}' : ']';
		p = skip_ws(p + 1, e);
		if (p < e && *p == close[d - 1]) {
			p++;
			d--;
			goto after;
		}
		if (close[d - 1] == ']')
			goto value;
		goto key;
	case '"':
		p = chk_string(p, e);
		break;
	case 't':
		p = chk_lit(p, e, "true");
		break;
	case 'f':
		p = chk_lit(p, e, "false");
		break;
	case 'n':
		p = chk_lit(p, e, "null");
		break;
	default:
		p = chk_number(p, e);
	}
	if (p == NULL)
		return NULL;
after:
	if (d == 0)
		return p;
	p = skip_ws(p, e);
	if (p >= e)
		return NULL;
	if (*p == close[d - 1]) {
		p++;
		d--;
		goto after;
	}
	if (*p != ',')
		return NULL;
	p = skip_ws(p + 1, e);
	if (close[d - 1] == ']')
		goto value;
key:
	if (p >= e || *p != '"' || (p = chk_string(p, e)) == NULL)
		return NULL;
	p = skip_ws(p, e);
	if (p >= e || *p != ':')
		return NULL;
	p++;
	goto value;
}

int js_doc(const char *buf, size_t len, size_t max, js_span *obj, char *why,
           size_t whylen)
{
	if (buf == NULL || len == 0)
		return ecx_why(why, whylen, ECX_EPROTO, "empty message");
	if (len > max)
		return ecx_why(why, whylen, ECX_ETOOBIG,
		               "message of %zu bytes exceeds the limit of %zu",
		               len, max);
	const char *p = buf, *e = buf + len;
	if (len >= 3 && memcmp(p, "\xEF\xBB\xBF", 3) == 0)
		p += 3;
	p = skip_ws(p, e);
	const char *start = p;
	const char *end = chk_value(p, e);
	if (end == NULL)
		return ecx_why(why, whylen, ECX_EPROTO, "not valid JSON");
	for (const char *t = end; t < e; t++)
		if (!js_ws(*t) && *t != '\0')
			return ecx_why(why, whylen, ECX_EPROTO,
			               "trailing bytes after the JSON value");
	if (*start != '{')
		return ecx_why(why, whylen, ECX_EPROTO,
		               "message is not a JSON object");
	obj->p = start;
	obj->n = (size_t)(end - start);
	return 0;
}

/* ---- walking checked bytes ---- */

/* The byte after the checked string opening at p: its closing quote is
 * the first '"' with no backslash before it. */
static const char *str_end(const char *p, const char *e)
{
	for (p++; p < e;) {
		const char *q = memchr(p, '"', (size_t)(e - p));
		if (q == NULL)
			return e;
		const char *b = q;
		while (b > p && b[-1] == '\\')
			b--;
		if ((q - b) % 2 == 0)
			return q + 1;
		p = q + 1;
	}
	return e;
}

/* The byte after the checked value at p. */
static const char *skip_checked(const char *p, const char *e)
{
	if (p >= e)
		return e;
	if (*p == '"')
		return str_end(p, e);
	if (*p != '{' && *p != '[') {
		while (p < e && !js_ws(*p) && *p != ',' && *p != ']' &&
		       *p != '}')
			p++;
		return p;
	}
	int d = 0;
	while (p < e) {
		char c = *p;
		if (c == '"') {
			p = str_end(p, e);
			continue;
		}
		if (c == '{' || c == '[')
			d++;
		else if ((c == '}' || c == ']') && --d == 0)
			return p + 1;
		p++;
	}
	return e;
}

js_iter js_enter(js_span v)
{
	js_iter it = {v.p + 1, v.p + v.n};
	return it;
}

/* Past the separator before the next member or element; false, with p
 * past the container's closing bracket, at its end. */
static bool iter_next(js_iter *it)
{
	const char *p = skip_ws(it->p, it->end);
	if (p < it->end && *p == ',')
		p = skip_ws(p + 1, it->end);
	if (p < it->end && (*p == '}' || *p == ']')) {
		it->p = p + 1;
		return false;
	}
	it->p = p;
	return p < it->end;
}

bool js_key(js_iter *it, js_span *key)
{
	if (!iter_next(it))
		return false;
	const char *k = it->p, *p = str_end(k, it->end);
	key->p = k;
	key->n = (size_t)(p - k);
	p = skip_ws(p, it->end);
	it->p = skip_ws(p + 1, it->end); /* past the ':' */
	return true;
}

void js_value(js_iter *it, js_span *val)
{
	const char *v = it->p;
	it->p = skip_checked(v, it->end);
	val->p = v;
	val->n = (size_t)(it->p - v);
}

char js_at(const js_iter *it)
{
	js_span v = {it->p, (size_t)(it->end - it->p)};
	return js_kind(v);
}

js_iter js_descend(const js_iter *it)
{
	js_iter sub = {it->p + 1, it->end};
	return sub;
}

bool js_elem(js_iter *it, js_span *val)
{
	if (!iter_next(it))
		return false;
	js_value(it, val);
	return true;
}

bool js_member(js_iter *it, js_span *key, js_span *val)
{
	if (!js_key(it, key))
		return false;
	js_value(it, val);
	return true;
}

size_t js_count(js_span v)
{
	js_iter it = js_enter(v);
	js_span k, x;
	size_t n = 0;
	if (*v.p == '{')
		while (js_member(&it, &k, &x))
			n++;
	else
		while (js_elem(&it, &x))
			n++;
	return n;
}

char js_kind(js_span v)
{
	if (v.n == 0)
		return '\0';
	char c = v.p[0];
	if (c == '-' || is_digit(c))
		return 'n';
	return c == 'n' ? 'l' : c;
}

size_t js_unescape(js_span s, char *out, size_t cap)
{
	const char *p = s.p + 1, *e = s.p + s.n - 1;
	size_t n = 0;
	if (memchr(p, '\\', (size_t)(e - p)) == NULL) {
		n = (size_t)(e - p);
		size_t k = n < cap ? n : cap - 1;
		memcpy(out, p, k);
		out[k] = '\0';
		return n;
	}
#define PUT(ch)                         \
	do {                            \
		char put_ = (char)(ch); \
		if (n + 1 < cap)        \
			out[n] = put_;  \
		n++;                    \
	} while (0)
	while (p < e) {
		if (*p != '\\') {
			PUT(*p++);
			continue;
		}
		char c = p[1];
		p += 2;
		switch (c) {
		case 'b':
			PUT('\b');
			break;
		case 'f':
			PUT('\f');
			break;
		case 'n':
			PUT('\n');
			break;
		case 'r':
			PUT('\r');
			break;
		case 't':
			PUT('\t');
			break;
		case 'u': {
			unsigned long u = (unsigned long)hex4(p, e);
			p += 4;
			if (u >= 0xD800 && u <= 0xDBFF) {
				unsigned long l = (unsigned long)hex4(p + 2, e);
				p += 6;
				u = 0x10000 + ((u & 0x3FF) << 10 | (l & 0x3FF));
			}
			if (u < 0x80) {
				PUT(u);
			} else if (u < 0x800) {
				PUT(0xC0 | u >> 6);
				PUT(0x80 | (u & 0x3F));
			} else if (u < 0x10000) {
				PUT(0xE0 | u >> 12);
				PUT(0x80 | (u >> 6 & 0x3F));
				PUT(0x80 | (u & 0x3F));
			} else {
				PUT(0xF0 | u >> 18);
				PUT(0x80 | (u >> 12 & 0x3F));
				PUT(0x80 | (u >> 6 & 0x3F));
				PUT(0x80 | (u & 0x3F));
			}
			break;
		}
		default: /* '"', '\\', '/' */
			PUT(c);
		}
	}
#undef PUT
	out[n < cap ? n : cap - 1] = '\0';
	return n;
}

bool js_eqn(js_span s, const char *lit, size_t n)
{
	if (s.n == n + 2 && memcmp(s.p + 1, lit, n) == 0)
		return true;
	if (memchr(s.p, '\\', s.n) == NULL)
		return false;
	char buf[64];
	return n < sizeof(buf) && js_unescape(s, buf, sizeof(buf)) == n &&
	       memcmp(buf, lit, n) == 0;
}

int js_get_u64(js_span v, const char *key, uint64_t *out, char *why,
               size_t whylen)
{
	if (js_kind(v) != 'n')
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is not a number", key);
	size_t k = 0;
	uint64_t x = 0;
	while (k < v.n && k < 19 && is_digit(v.p[k]))
		x = x * 10 + (uint64_t)(v.p[k++] - '0');
	if (k == v.n) { /* digits only: exact */
		if (x >= ECX_JSON_INT_MAX)
			return ecx_why(why, whylen, ECX_EPROTO,
			               "\"%s\" is out of range (at most "
			               "2^53-1)",
			               key);
		*out = x;
		return 0;
	}
	/* A sign, a fraction or an exponent: read as cJSON reads numbers,
	 * as a double, and held to the same rules as ecx_json_get_u64. */
	char tmp[64];
	if (v.n >= sizeof(tmp))
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is out of range (at most 2^53-1)", key);
	memcpy(tmp, v.p, v.n);
	tmp[v.n] = '\0';
	return ecx_json_double_u64(strtod(tmp, NULL), key, out, why, whylen);
}
