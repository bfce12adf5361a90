/*
 * jstream.h - JSON without a tree, for the codecs on the lookup path
 * (entries, batched lookups): a writer that appends to one growing buffer,
 * and a reader that first checks a whole message once (RFC 8259 syntax,
 * nesting at most JS_DEPTH) and then walks the checked bytes, member by
 * member, with no allocation per value. Private to wire/.
 *
 * The writer prints exactly what cJSON_PrintUnformatted prints for the same
 * values (no spaces; strings escaped as cJSON escapes them; integers as
 * digits), so peers see the same bytes as from the tree codecs.
 *
 * The reader accepts a subset of what cJSON accepts, with the same meaning:
 * where an object repeats a key, the first one counts (as
 * cJSON_GetObjectItemCaseSensitive finds it); a UTF-8 byte order mark may
 * open the message. It refuses what cJSON lets through beyond the RFC: raw
 * control characters in strings, "\u0000" and bad "\u" escapes, numbers
 * such as "01" or "1.", control characters other than the RFC's four as
 * whitespace.
 */
#ifndef ECX_WIRE_JSTREAM_H
#define ECX_WIRE_JSTREAM_H

#include "core/core.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define JS_DEPTH 1000 /* as cJSON's CJSON_NESTING_LIMIT */

/* ---- writer ---- */

/* The message being written; failed once an allocation failed (every
 * later append is then a no-op). */
typedef struct js_out {
	char *p;
	size_t len, cap;
	bool failed;
} js_out;

/* Makes room for n more bytes; false when out of memory. */
bool js_reserve(js_out *o, size_t n);
void js_raw(js_out *o, const char *s, size_t n);
/* s: a string literal (its size is taken). */
#define js_lit(o, s) js_raw((o), "" s, sizeof(s) - 1)
/* A quoted string, escaped as cJSON escapes it: '"', '\\', \b \f \n \r \t,
 * other bytes below 0x20 as \u00xx; every other byte as it is. */
void js_str(js_out *o, const char *s);
void js_u64(js_out *o, uint64_t v);
/* The NUL-terminated message (the caller frees it), or NULL when an
 * append failed (then nothing is left to free). */
char *js_done(js_out *o);

/* ---- reader ---- */

/* Bytes of one JSON value, or a string's bytes with their quotes. */
typedef struct js_span {
	const char *p;
	size_t n;
} js_span;

/* Checks buf[0, len) holds one JSON object, with only whitespace or NULs
 * after it (as ecx_json_parse allows), and at most max bytes; *obj is set
 * to the object's bytes. On failure: ECX_ETOOBIG over max, else
 * ECX_EPROTO, with why saying which (the same words as ecx_json_parse). */
int js_doc(const char *buf, size_t len, size_t max, js_span *obj, char *why,
           size_t whylen);

/* Walks the members of a checked object or the elements of a checked
 * array: js_enter positions it, js_member and js_elem return false after
 * the last one. key is the member's name with its quotes. */
typedef struct js_iter {
	const char *p, *end;
} js_iter;

js_iter js_enter(js_span v);
bool js_member(js_iter *it, js_span *key, js_span *val);
bool js_elem(js_iter *it, js_span *val);
/* The same walk in two steps, for callers that read a member's value in
 * place: js_key returns the next member's name and leaves the iterator at
 * its value; js_value then takes the value as a span, or js_at says what
 * it is and js_descend walks it (when that walk ends, its p is past the
 * value, where the outer walk goes on). */
bool js_key(js_iter *it, js_span *key);
void js_value(js_iter *it, js_span *val);
char js_at(const js_iter *it);
js_iter js_descend(const js_iter *it);
/* Members or elements of a checked object or array. */
size_t js_count(js_span v);

/* What a checked value is, by its first byte: '{', '[', '"', 'n' (a
 * number), 't', 'f' or 'l' (null). */
char js_kind(js_span v);
/* Whether a checked string (with its quotes) reads lit (n bytes, no
 * backslash); js_eq takes a string literal. */
bool js_eqn(js_span s, const char *lit, size_t n);
#define js_eq(s, lit) js_eqn((s), "" lit, sizeof(lit) - 1)
/* Decodes a checked string (with its quotes) into out (cap > 0 bytes,
 * always NUL-terminated, cut short when it does not fit). Returns the
 * decoded length, which may be cap or more (then it was cut). A checked
 * string holds no NUL byte. */
size_t js_unescape(js_span s, char *out, size_t cap);
/* Reads a checked value as an integer in [0, 2^53), with the reasons of
 * ecx_json_get_u64 for what is not ("\"key\" is not a number", is
 * negative, is not an integer, is out of range). */
int js_get_u64(js_span v, const char *key, uint64_t *out, char *why,
               size_t whylen);

#endif /* ECX_WIRE_JSTREAM_H */
