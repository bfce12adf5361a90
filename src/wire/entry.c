/* entry.c - the registry entry and the batched lookup, written and read
 * without a tree (jstream.h), with the bytes and rules of the entry's
 * cJSON forms (entry_tree.c, for the listing). */
#include "wire.h"

#include "wire/jstream.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Appends e as cJSON prints ecx_entry_to_json(e); false for what that
 * refuses (more than ECX_MAX_DIMS dimensions). */
static bool entry_write(js_out *o, const ecx_entry *e)
{
	if (e->desc.ndim > ECX_MAX_DIMS)
		return false;
	js_lit(o, "{\"nbytes\":");
	js_u64(o, e->desc.nbytes);
	js_lit(o, ",\"shape\":[");
	for (uint32_t i = 0; i < e->desc.ndim; i++) {
		if (i > 0)
			js_lit(o, ",");
		js_u64(o, e->desc.shape[i]);
	}
	const char *dt = core_dtype_name(e->desc.dtype);
	js_lit(o, "],\"dtype\":");
	js_str(o, dt != NULL ? dt : "invalid");
	js_lit(o, ",\"producer_zmq\":");
	js_str(o, e->producer_zmq);
	if (e->epoch != 0) {
		js_lit(o, ",\"ecx_epoch\":");
		js_u64(o, e->epoch);
	}
	if (e->ttl_s != 0) {
		js_lit(o, ",\"ecx_ttl_s\":");
		js_u64(o, e->ttl_s);
	}
	if (e->age_ms != 0) {
		js_lit(o, ",\"ecx_age_ms\":");
		js_u64(o, e->age_ms);
	}
	if (e->lease != 0) {
		js_lit(o, ",\"ecx_lease\":");
		js_u64(o, e->lease);
	}
	js_lit(o, "}");
	return true;
}

char *ecx_entry_encode(const ecx_entry *e)
{
	js_out o = {0};
	if (!entry_write(&o, e)) {
		free(o.p);
		return NULL;
	}
	return js_done(&o);
}

/* ---- reading an entry without a tree ---- */

enum {
	F_NBYTES,
	F_SHAPE,
	F_DTYPE,
	F_PRODUCER,
	F_EPOCH,
	F_TTL,
	F_AGE,
	F_LEASE,
	NF
};
#define KEY(s)                   \
	{                        \
		s, sizeof(s) - 1 \
	}
static const struct {
	const char *s;
	size_t n;
} entry_keys[NF] = {KEY("nbytes"),       KEY("shape"),     KEY("dtype"),
                    KEY("producer_zmq"), KEY("ecx_epoch"), KEY("ecx_ttl_s"),
                    KEY("ecx_age_ms"),   KEY("ecx_lease")};
#undef KEY

/* A string field of at most cap-1 bytes, with ecx_json_get_str's
 * reasons. */
static int field_str(const js_span *f, bool have, const char *key, char *out,
                     size_t cap, char *why, size_t whylen)
{
	if (!have)
		return ecx_why(why, whylen, ECX_EPROTO, "missing field \"%s\"",
		               key);
	if (js_kind(*f) != '"')
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is not a string", key);
	if (js_unescape(*f, out, cap) >= cap)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is longer than %zu bytes", key, cap - 1);
	return 0;
}

static int field_u64(const js_span *f, bool have, const char *key,
                     uint64_t *out, char *why, size_t whylen)
{
	if (!have)
		return ecx_why(why, whylen, ECX_EPROTO, "missing field \"%s\"",
		               key);
	return js_get_u64(*f, key, out, why, whylen);
}

/* Reads the checked value at it as an entry, with the rules and reasons
 * of ecx_entry_from_json, checked in the same order; the first of a
 * repeated key counts, unknown keys are skipped. it ends past the value. */
static int entry_read_at(js_iter *at, ecx_entry *out, char *why, size_t whylen)
{
	if (js_at(at) != '{') {
		js_span skip;
		js_value(at, &skip);
		return ecx_why(why, whylen, ECX_EPROTO,
		               "entry is not an object");
	}
	js_span f[NF];
	bool have[NF] = {false};
	js_iter it = js_descend(at);
	js_span key, val;
	while (js_member(&it, &key, &val))
		for (int k = 0; k < NF; k++)
			if (!have[k] &&
			    js_eqn(key, entry_keys[k].s, entry_keys[k].n)) {
				have[k] = true;
				f[k] = val;
				break;
			}
	at->p = it.p;
	ecx_entry e;
	memset(&e, 0, sizeof(e));
	int rc = field_u64(&f[F_NBYTES], have[F_NBYTES], "nbytes",
	                   &e.desc.nbytes, why, whylen);
	if (rc != 0)
		return rc;
	if (!have[F_SHAPE])
		return ecx_why(why, whylen, ECX_EPROTO,
		               "missing field \"shape\"");
	if (js_kind(f[F_SHAPE]) != '[')
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"shape\" is not an array");
	size_t nd = js_count(f[F_SHAPE]);
	if (nd > ECX_MAX_DIMS)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"shape\" has %zu dimensions; at most %d", nd,
		               ECX_MAX_DIMS);
	e.desc.ndim = (uint32_t)nd;
	it = js_enter(f[F_SHAPE]);
	for (int i = 0; js_elem(&it, &val); i++) {
		char sub[8];
		if (js_get_u64(val, "", &e.desc.shape[i], sub, sizeof(sub)) !=
		    0)
			return ecx_why(why, whylen, ECX_EPROTO,
			               "\"shape\"[%d] is not a non-negative "
			               "integer below 2^53",
			               i);
	}
	char dt[32];
	rc = field_str(&f[F_DTYPE], have[F_DTYPE], "dtype", dt, sizeof(dt), why,
	               whylen);
	if (rc != 0)
		return rc;
	if (core_dtype_parse(dt, &e.desc.dtype) != 0)
		return ecx_why(why, whylen, ECX_EDTYPE, "unknown dtype \"%s\"",
		               dt);
	rc = core_tensor_check(&e.desc, why, whylen);
	if (rc != 0)
		return rc;
	rc = field_str(&f[F_PRODUCER], have[F_PRODUCER], "producer_zmq",
	               e.producer_zmq, sizeof(e.producer_zmq), why, whylen);
	if (rc != 0)
		return rc;
	if (e.producer_zmq[0] == '\0')
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"producer_zmq\" is empty");
	if (have[F_EPOCH] && (rc = js_get_u64(f[F_EPOCH], "ecx_epoch", &e.epoch,
	                                      why, whylen)) != 0)
		return rc;
	if (have[F_TTL]) {
		uint64_t t = 0;
		rc = js_get_u64(f[F_TTL], "ecx_ttl_s", &t, why, whylen);
		if (rc != 0)
			return rc;
		if (t > ECX_TTL_MAX_S)
			return ecx_why(why, whylen, ECX_EPROTO,
			               "\"ecx_ttl_s\" is over %d",
			               ECX_TTL_MAX_S);
		e.ttl_s = (uint32_t)t;
	}
	if (have[F_AGE] && (rc = js_get_u64(f[F_AGE], "ecx_age_ms", &e.age_ms,
	                                    why, whylen)) != 0)
		return rc;
	if (have[F_LEASE] && (rc = js_get_u64(f[F_LEASE], "ecx_lease", &e.lease,
	                                      why, whylen)) != 0)
		return rc;
	*out = e;
	return 0;
}

/* entry_read_at on the checked value v. */
static int entry_read(js_span v, ecx_entry *out, char *why, size_t whylen)
{
	js_iter it = {v.p, v.p + v.n};
	return entry_read_at(&it, out, why, whylen);
}

int ecx_entry_decode(const char *buf, size_t len, ecx_entry *out, char *why,
                     size_t whylen)
{
	js_span o;
	int rc = js_doc(buf, len, ECX_ENTRY_MAX, &o, why, whylen);
	return rc != 0 ? rc : entry_read(o, out, why, whylen);
}

void ecx_lookup_items_clear(ecx_lookup_item *items, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		free(items[i].alt);
		items[i].alt = NULL;
		items[i].nalt = 0;
	}
}

/* ---- batched lookup ---- */

char *ecx_lookup_req_encode(const char *const *ids, size_t n)
{
	return ecx_lookup_req_encode_lease(ids, n, 0);
}

char *ecx_lookup_req_encode_lease(const char *const *ids, size_t n,
                                  uint64_t lease_ms)
{
	js_out o = {0};
	js_reserve(&o, 16 + n * 72);
	js_lit(&o, "{\"ids\":[");
	for (size_t i = 0; i < n; i++) {
		if (i > 0)
			js_lit(&o, ",");
		js_str(&o, ids[i]);
	}
	js_lit(&o, "]");
	if (lease_ms != 0) {
		js_lit(&o, ",\"ecx_lease_ms\":");
		js_u64(&o, lease_ms);
	}
	js_lit(&o, "}");
	return js_done(&o);
}

/* The first members of checked object o named keys[0..n) into vals
 * (have[i]: found), in one pass. */
static void members_of(js_span o, const char *const *keys, size_t n,
                       js_span *vals, bool *have)
{
	js_iter it = js_enter(o);
	js_span k, v;
	for (size_t i = 0; i < n; i++)
		have[i] = false;
	while (js_member(&it, &k, &v))
		for (size_t i = 0; i < n; i++)
			if (!have[i] && js_eqn(k, keys[i], strlen(keys[i]))) {
				have[i] = true;
				vals[i] = v;
				break;
			}
}

/* Reads the checked string s, "ids"[i], as an id into out (ECX_ID_MAX + 1
 * bytes), with ecx_json_id's reasons. */
static int read_id(js_span s, size_t i, char *out, char *why, size_t whylen)
{
	if (js_kind(s) != '"')
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"ids\"[%zu] is not a string", i);
	char id[ECX_ID_MAX + 2], r[160];
	size_t n = js_unescape(s, id, sizeof(id));
	if (core_id_check(id, r, sizeof(r)) != 0)
		return ecx_why(why, whylen, ECX_EID, "\"ids\"[%zu]: %s", i, r);
	memcpy(out, id, n + 1);
	return 0;
}

int ecx_lookup_req_decode(const char *buf, size_t len, ecx_idlist *out,
                          char *why, size_t whylen)
{
	static const char *const keys[] = {"ids", "ecx_lease_ms"};
	js_span o, v[2];
	bool have[2];
	int rc = js_doc(buf, len, ECX_WIRE_MAX, &o, why, whylen);
	if (rc != 0)
		return rc;
	members_of(o, keys, 2, v, have);
	uint64_t lease_ms = 0;
	if (have[1] && (rc = js_get_u64(v[1], "ecx_lease_ms", &lease_ms, why,
	                                whylen)) != 0)
		return rc;
	js_span arr = v[0];
	if (!have[0])
		return ecx_why(why, whylen, ECX_EPROTO,
		               "missing field \"ids\"");
	if (js_kind(arr) != '[')
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"ids\" is not an array");
	size_t n = js_count(arr);
	if (n > ECX_LOOKUP_MAX_IDS)
		return ecx_why(why, whylen, ECX_ETOOBIG,
		               "%zu ids in one lookup; at most %d", n,
		               ECX_LOOKUP_MAX_IDS);
	ecx_idlist l = {0, malloc((n > 0 ? n : 1) * sizeof(*l.ids)), lease_ms};
	if (l.ids == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	js_iter it = js_enter(arr);
	js_span s;
	while (js_elem(&it, &s)) {
		rc = read_id(s, l.n, l.ids[l.n], why, whylen);
		if (rc != 0) {
			free(l.ids);
			return rc;
		}
		l.n++;
	}
	*out = l;
	return 0;
}

size_t ecx_id_hash(const char *id)
{
	size_t n = strlen(id);
	uint64_t h = 0x9e3779b97f4a7c15ull ^ n, w;
	for (; n >= 8; n -= 8, id += 8) {
		memcpy(&w, id, 8);
		h = (h ^ w) * 0xff51afd7ed558ccdull;
		h ^= h >> 32;
	}
	w = 0;
	memcpy(&w, id, n);
	h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
	return (size_t)(h ^ h >> 29);
}

/* The distinct ids of a batch, in an open-addressing table: first[] holds
 * 1 + the index of the first item asked with each id (0: an empty slot),
 * next[i] 1 + the index of the next item asked with item i's id (0: none).
 * ECX_LOOKUP_MAX_IDS bounds a batch, so indices fit. */
typedef struct id_set {
	size_t mask, distinct;
	uint32_t *first, *next;
} id_set;

static void id_set_free(id_set *t)
{
	free(t->first);
	free(t->next);
}

/* Builds the set of items[0..n); false when out of memory. */
static bool id_set_build(id_set *t, const ecx_lookup_item *items, size_t n)
{
	size_t cap = 16;
	while (cap < 2 * n)
		cap *= 2;
	t->mask = cap - 1;
	t->distinct = 0;
	t->first = calloc(cap, sizeof(*t->first));
	t->next = calloc(n + 1, sizeof(*t->next));
	if (t->first == NULL || t->next == NULL) {
		id_set_free(t);
		return false;
	}
	for (size_t i = 0; i < n; i++) {
		size_t h = ecx_id_hash(items[i].id) & t->mask;
		while (t->first[h] != 0 &&
		       strcmp(items[t->first[h] - 1].id, items[i].id) != 0)
			h = (h + 1) & t->mask;
		if (t->first[h] == 0) {
			t->first[h] = (uint32_t)i + 1;
			t->distinct++;
			continue;
		}
		uint32_t k = t->first[h] - 1;
		while (t->next[k] != 0)
			k = t->next[k] - 1;
		t->next[k] = (uint32_t)i + 1;
	}
	return true;
}

/* The index of the first item asked as id, or n when none was. */
static size_t id_set_find(const id_set *t, const ecx_lookup_item *items,
                          size_t n, const char *id)
{
	size_t h = ecx_id_hash(id) & t->mask;
	for (; t->first[h] != 0; h = (h + 1) & t->mask)
		if (strcmp(items[t->first[h] - 1].id, id) == 0)
			return t->first[h] - 1;
	return n;
}

char *ecx_lookup_resp_encode(const ecx_lookup_item *items, size_t n)
{
	/* Each distinct id is answered once, however often it was asked. */
	id_set t;
	bool *dup = calloc(n + 1, sizeof(*dup));
	if (dup == NULL || !id_set_build(&t, items, n)) {
		free(dup);
		return NULL;
	}
	for (size_t i = 0; i < n; i++)
		for (uint32_t k = t.next[i]; k != 0; k = t.next[k - 1])
			dup[k - 1] = true;
	id_set_free(&t);
	/* The members in the order the tree codec added them: "found",
	 * "missing", then "ecx_holders" when an id has several holders (the
	 * reference's clients read "found" only). */
	js_out o = {0};
	js_reserve(&o, 64 + n * 224);
	js_lit(&o, "{\"found\":{");
	bool first = true, ok = true;
	for (size_t i = 0; i < n && ok; i++) {
		if (dup[i] || !items[i].found)
			continue;
		if (!first)
			js_lit(&o, ",");
		first = false;
		js_str(&o, items[i].id);
		js_lit(&o, ":");
		ok = entry_write(&o, &items[i].entry);
	}
	js_lit(&o, "},\"missing\":[");
	first = true;
	for (size_t i = 0; i < n; i++) {
		if (dup[i] || items[i].found)
			continue;
		if (!first)
			js_lit(&o, ",");
		first = false;
		js_str(&o, items[i].id);
	}
	js_lit(&o, "]");
	first = true;
	for (size_t i = 0; i < n && ok; i++) {
		const ecx_lookup_item *it = &items[i];
		if (dup[i] || !it->found || it->nalt == 0)
			continue;
		ok = it->nalt <= ECX_HOLDERS_MAX - 1;
		if (first)
			js_lit(&o, ",\"ecx_holders\":{");
		else
			js_lit(&o, ",");
		first = false;
		js_str(&o, it->id);
		js_lit(&o, ":[");
		ok = ok && entry_write(&o, &it->entry);
		for (uint32_t k = 0; k < it->nalt && ok; k++) {
			js_lit(&o, ",");
			ok = entry_write(&o, &it->alt[k]);
		}
		js_lit(&o, "]");
	}
	if (!first)
		js_lit(&o, "}");
	js_lit(&o, "}");
	free(dup);
	if (!ok) {
		free(o.p);
		return NULL;
	}
	return js_done(&o);
}

/* The index of the first item asked as the checked string s, or n when
 * none was. */
static size_t item_find(const id_set *t, const ecx_lookup_item *items, size_t n,
                        js_span s)
{
	char id[ECX_ID_MAX + 2];
	if (js_kind(s) != '"' || js_unescape(s, id, sizeof(id)) > ECX_ID_MAX)
		return n;
	return id_set_find(t, items, n, id);
}

int ecx_lookup_resp_decode(const char *buf, size_t len, ecx_lookup_item *items,
                           size_t n, char *why, size_t whylen)
{
	/* Output only: what items held before is not freed here. */
	for (size_t i = 0; i < n; i++) {
		items[i].found = false;
		items[i].alt = NULL;
		items[i].nalt = 0;
	}
	/* The items by id, so that each id of the reply is found at once. */
	id_set t;
	if (!id_set_build(&t, items, n))
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	js_span o, v[3], key, c;
	bool have[3] = {false};
	int rc = js_doc(buf, len, ECX_WIRE_MAX, &o, why, whylen);
	if (rc != 0) {
		id_set_free(&t);
		return rc;
	}
	/* One walk: "found" is read in place (the registry writes it first),
	 * "missing" and "ecx_holders" after it, since they refer to it. */
	size_t nf = 0, nm = 0;
	js_iter top = js_enter(o);
	while (js_key(&top, &key)) {
		int w = js_eq(key, "found")         ? 0
		        : js_eq(key, "missing")     ? 1
		        : js_eq(key, "ecx_holders") ? 2
		                                    : -1;
		if (w < 0 || have[w] || w > 0 || js_at(&top) != '{') {
			js_span skip;
			js_value(&top, w >= 0 && !have[w] ? &v[w] : &skip);
			if (w >= 0)
				have[w] = true;
			continue;
		}
		have[0] = true;
		v[0] = (js_span){"{}", 2};
		js_iter it = js_descend(&top);
		while (js_key(&it, &key)) {
			size_t k = item_find(&t, items, n, key);
			if (k == n) {
				rc =
				    ecx_why(why, whylen, ECX_EPROTO,
				            "lookup reply names an id that was "
				            "not asked for");
				goto out;
			}
			if (items[k].found) {
				/* A repeated key counts once, its first value.
				 */
				js_span skip;
				js_value(&it, &skip);
				continue;
			}
			rc = entry_read_at(&it, &items[k].entry, why, whylen);
			if (rc != 0)
				goto out;
			items[k].found = true;
			nf++;
			for (uint32_t d = t.next[k]; d != 0;
			     d = t.next[d - 1]) {
				items[d - 1].entry = items[k].entry;
				items[d - 1].found = true;
			}
		}
		top.p = it.p;
	}
	js_span missing = v[1];
	if (!have[0] || js_kind(v[0]) != '{' || !have[1] ||
	    js_kind(missing) != '[') {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "lookup reply needs \"found\" (object) and "
		             "\"missing\" (array)");
		goto out;
	}
	js_iter it;
	/* The other holders of an id found, when the registry has them. */
	bool has_holders = have[2] && js_kind(v[2]) == '{';
	it = js_enter(has_holders ? v[2] : (js_span){"{}", 2});
	while (js_member(&it, &key, &c)) {
		if (js_kind(c) != '[' || js_count(c) > ECX_HOLDERS_MAX) {
			char name[65];
			js_unescape(key, name, sizeof(name));
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "lookup reply's \"ecx_holders\" of '%s' "
			             "is not an array of at most %d entries",
			             name, ECX_HOLDERS_MAX);
			goto out;
		}
		size_t k = item_find(&t, items, n, key);
		for (; k < n; k = t.next[k] != 0 ? t.next[k] - 1 : n) {
			ecx_lookup_item *x = &items[k];
			if (!x->found)
				continue;
			free(x->alt);
			x->nalt = 0;
			x->alt =
			    malloc((ECX_HOLDERS_MAX - 1) * sizeof(*x->alt));
			if (x->alt == NULL) {
				rc = ecx_why(why, whylen, ECX_ENOMEM,
				             "out of memory");
				goto out;
			}
			js_iter h = js_enter(c);
			js_span hv;
			while (js_elem(&h, &hv)) {
				ecx_entry e;
				rc = entry_read(hv, &e, why, whylen);
				if (rc != 0)
					goto out;
				if (strcmp(e.producer_zmq,
				           x->entry.producer_zmq) == 0 ||
				    x->nalt == ECX_HOLDERS_MAX - 1)
					continue;
				x->alt[x->nalt++] = e;
			}
		}
	}
	it = js_enter(missing);
	for (; js_elem(&it, &c); nm++) {
		size_t k = item_find(&t, items, n, c);
		if (k == n || items[k].found) {
			rc =
			    ecx_why(why, whylen, ECX_EPROTO,
			            "lookup reply's \"missing\" has an id that "
			            "was not asked for");
			goto out;
		}
	}
	/* The reply answers each distinct requested id once. */
	if (nf + nm != t.distinct)
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "lookup reply answers %zu ids, expected %zu",
		             nf + nm, t.distinct);
out:
	if (rc != 0) {
		ecx_lookup_items_clear(items, n);
		for (size_t i = 0; i < n; i++)
			items[i].found = false;
	}
	id_set_free(&t);
	return rc;
}
