/* Unit tests for src/wire: every codec's round trip and each rejection. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "wire/wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ID64 "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

static ecx_entry sample_entry(void)
{
	ecx_entry e;
	memset(&e, 0, sizeof(e));
	uint64_t shape[] = {1369, 3584};
	assert_int_equal(ecx_tensor_set(&e.desc, ECX_DTYPE_BFLOAT16, 2, shape),
	                 0);
	strcpy(e.producer_zmq, "tcp://10.0.0.2:5555");
	e.epoch = 77;
	return e;
}

static int dec_entry(const char *s, char *why)
{
	ecx_entry e;
	return ecx_entry_decode(s, strlen(s), &e, why, 160);
}

static void test_entry_roundtrip(void **state)
{
	(void)state;
	ecx_entry e = sample_entry(), back;
	char *s = ecx_entry_encode(&e);
	assert_non_null(s);
	/* The reference's four fields, exactly as it writes them. */
	assert_non_null(strstr(s, "\"nbytes\":9812992"));
	assert_non_null(strstr(s, "\"shape\":[1369,3584]"));
	assert_non_null(strstr(s, "\"dtype\":\"bfloat16\""));
	assert_non_null(strstr(s, "\"producer_zmq\":\"tcp://10.0.0.2:5555\""));
	char why[160];
	assert_int_equal(ecx_entry_decode(s, strlen(s), &back, why, 160), 0);
	assert_memory_equal(&back, &e, sizeof(e));
	free(s);
	/* Large values stay integers, not exponents. */
	uint64_t big[] = {(uint64_t)1 << 40};
	assert_int_equal(ecx_tensor_set(&e.desc, ECX_DTYPE_UINT8, 1, big), 0);
	s = ecx_entry_encode(&e);
	assert_non_null(strstr(s, "1099511627776"));
	assert_int_equal(ecx_entry_decode(s, strlen(s), &back, why, 160), 0);
	assert_int_equal(back.desc.nbytes, (uint64_t)1 << 40);
	free(s);
}

static void test_entry_reference(void **state)
{
	(void)state;
	/* What the reference publishes: no ecx fields, Python's spacing. */
	const char *ref = "{\"nbytes\": 24, \"shape\": [2, 3], \"dtype\": "
	                  "\"float32\", \"producer_zmq\": \"tcp://h:1\"}";
	ecx_entry e;
	char why[160];
	assert_int_equal(ecx_entry_decode(ref, strlen(ref), &e, why, 160), 0);
	assert_int_equal(e.desc.dtype, ECX_DTYPE_FLOAT32);
	assert_int_equal(e.epoch, 0);
	/* Unknown fields are ignored. */
	const char *more = "{\"nbytes\":1,\"shape\":[1],\"dtype\":\"uint8\","
	                   "\"producer_zmq\":\"tcp://h:1\",\"future\":[1]}";
	assert_int_equal(dec_entry(more, why), 0);
}

static void test_entry_rejects(void **state)
{
	(void)state;
	static const struct {
		const char *json;
		int err;
		const char *why;
	} bad[] = {
	    {"", ECX_EPROTO, "empty"},
	    {"{", ECX_EPROTO, "not valid JSON"},
	    {"[]", ECX_EPROTO, "not a JSON object"},
	    {"{} x", ECX_EPROTO, "trailing"},
	    {"{\"shape\":[1],\"dtype\":\"uint8\",\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "missing field \"nbytes\""},
	    {"{\"nbytes\":\"1\",\"shape\":[1],\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "not a number"},
	    {"{\"nbytes\":-1,\"shape\":[1],\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "negative"},
	    {"{\"nbytes\":1.5,\"shape\":[1],\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "not an integer"},
	    {"{\"nbytes\":1e300,\"shape\":[1],\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "out of range"},
	    {"{\"nbytes\":1,\"dtype\":\"uint8\",\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "missing field \"shape\""},
	    {"{\"nbytes\":1,\"shape\":1,\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "not an array"},
	    {"{\"nbytes\":1,\"shape\":[-1],\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "shape\"[0]"},
	    {"{\"nbytes\":1,\"shape\":[\"1\"],\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "shape\"[0]"},
	    {"{\"nbytes\":1,\"shape\":[1,1,1,1,1,1,1,1,1],\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "dimensions"},
	    {"{\"nbytes\":1,\"shape\":[1],\"dtype\":\"float\","
	     "\"producer_zmq\":\"a\"}",
	     ECX_EDTYPE, "unknown dtype"},
	    {"{\"nbytes\":1,\"shape\":[1],\"dtype\":7,\"producer_zmq\":\"a\"}",
	     ECX_EPROTO, "not a string"},
	    {"{\"nbytes\":3,\"shape\":[1],\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"a\"}",
	     ECX_ESIZE, "disagrees"},
	    {"{\"nbytes\":0,\"shape\":[4294967296,4294967296,4294967296],"
	     "\"dtype\":\"uint8\",\"producer_zmq\":\"a\"}",
	     ECX_ETOOBIG, "overflows"},
	    {"{\"nbytes\":1,\"shape\":[1],\"dtype\":\"uint8\"}", ECX_EPROTO,
	     "producer_zmq"},
	    {"{\"nbytes\":1,\"shape\":[1],\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"\"}",
	     ECX_EPROTO, "empty"},
	    {"{\"nbytes\":1,\"shape\":[1],\"dtype\":\"uint8\","
	     "\"producer_zmq\":\"a\",\"ecx_epoch\":-4}",
	     ECX_EPROTO, "negative"},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char why[160] = "";
		int rc = dec_entry(bad[i].json, why);
		if (rc != bad[i].err || strstr(why, bad[i].why) == NULL)
			fail_msg("case %zu (%s): got %s \"%s\"", i, bad[i].json,
			         ecx_err_name(rc), why);
	}
	/* Over the size limit. */
	size_t n = ECX_ENTRY_MAX + 10;
	char *big = malloc(n + 1);
	memset(big, ' ', n);
	big[0] = '{';
	big[n - 1] = '}';
	big[n] = '\0';
	char why[160];
	assert_int_equal(ecx_entry_decode(big, n, &(ecx_entry){0}, why, 160),
	                 ECX_ETOOBIG);
	free(big);
	/* A NUL inside the buffer, and a buffer cut short: no overread. */
	const char s[] = "{\"nbytes\":1}";
	assert_int_not_equal(ecx_entry_decode(s, 5, &(ecx_entry){0}, why, 160),
	                     0);
}

static void test_lookup(void **state)
{
	(void)state;
	const char *ids[] = {ID64, "lora:abc", "x"};
	char *req = ecx_lookup_req_encode(ids, 3);
	assert_non_null(req);
	ecx_idlist l;
	char why[160];
	assert_int_equal(ecx_lookup_req_decode(req, strlen(req), &l, why, 160),
	                 0);
	assert_int_equal(l.n, 3);
	assert_string_equal(l.ids[1], "lora:abc");
	assert_int_equal(l.lease_ms, 0);
	free(l.ids);
	free(req);
	/* A leased lookup carries its lease time; an entry its lease. */
	req = ecx_lookup_req_encode_lease(ids, 3, 30000);
	assert_non_null(strstr(req, "\"ecx_lease_ms\":30000"));
	assert_int_equal(ecx_lookup_req_decode(req, strlen(req), &l, why, 160),
	                 0);
	assert_int_equal(l.lease_ms, 30000);
	free(l.ids);
	free(req);
	const char *badms = "{\"ids\":[\"a\"],\"ecx_lease_ms\":-1}";
	assert_int_not_equal(
	    ecx_lookup_req_decode(badms, strlen(badms), &l, why, 160), 0);
	ecx_entry le = sample_entry(), leb;
	char *ej = ecx_entry_encode(&le);
	assert_null(strstr(ej, "ecx_lease"));
	free(ej);
	le.lease = 9007199254740991ull;
	ej = ecx_entry_encode(&le);
	assert_int_equal(ecx_entry_decode(ej, strlen(ej), &leb, why, 160), 0);
	assert_true(leb.lease == le.lease);
	free(ej);

	ecx_lookup_item items[3] = {
	    {.id = ID64}, {.id = "lora:abc"}, {.id = "x"}};
	items[0].found = true;
	items[0].entry = sample_entry();
	items[2].found = true;
	items[2].entry = sample_entry();
	char *resp = ecx_lookup_resp_encode(items, 3);
	assert_non_null(resp);
	ecx_lookup_item back[3] = {
	    {.id = ID64}, {.id = "lora:abc"}, {.id = "x"}};
	assert_int_equal(
	    ecx_lookup_resp_decode(resp, strlen(resp), back, 3, why, 160), 0);
	assert_true(back[0].found);
	assert_false(back[1].found);
	assert_true(back[2].found);
	assert_memory_equal(&back[2].entry, &items[2].entry, sizeof(ecx_entry));
	/* Ids asked twice are answered once, and decode for both askers. */
	ecx_lookup_item twice[3] = {
	    {.id = "x"}, {.id = "lora:abc"}, {.id = "x"}};
	twice[0].found = twice[2].found = true;
	twice[0].entry = twice[2].entry = sample_entry();
	char *tw = ecx_lookup_resp_encode(twice, 3);
	ecx_lookup_item tb[3] = {{.id = "x"}, {.id = "lora:abc"}, {.id = "x"}};
	assert_int_equal(
	    ecx_lookup_resp_decode(tw, strlen(tw), tb, 3, why, 160), 0);
	assert_true(tb[0].found && !tb[1].found && tb[2].found);
	free(tw);
	/* A repeated key counts once: an answer that names one id twice and
	 * another never leaves that other neither found nor missing. */
	ecx_lookup_item two[2] = {{.id = "idA"}, {.id = "idB"}};
	two[0].found = two[1].found = true;
	two[0].entry = two[1].entry = sample_entry();
	char *dup = ecx_lookup_resp_encode(two, 2);
	char *b = strstr(dup, "\"idB\":");
	assert_non_null(b);
	b[3] = 'A';
	ecx_lookup_item db[2] = {{.id = "idA"}, {.id = "idB"}};
	assert_int_equal(
	    ecx_lookup_resp_decode(dup, strlen(dup), db, 2, why, 160),
	    ECX_EPROTO);
	free(dup);
	/* A reply that does not answer what was asked. */
	ecx_lookup_item other[2] = {{.id = ID64}, {.id = "y"}};
	assert_int_equal(
	    ecx_lookup_resp_decode(resp, strlen(resp), other, 2, why, 160),
	    ECX_EPROTO);
	assert_false(other[0].found);
	free(resp);

	static const struct {
		const char *json;
		int err;
	} bad[] = {
	    {"{}", ECX_EPROTO},
	    {"{\"ids\":\"x\"}", ECX_EPROTO},
	    {"{\"ids\":[1]}", ECX_EPROTO},
	    {"{\"ids\":[\"a/b\"]}", ECX_EID},
	    {"{\"ids\":[\"\"]}", ECX_EID},
	    {"nope", ECX_EPROTO},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int rc = ecx_lookup_req_decode(bad[i].json, strlen(bad[i].json),
		                               &l, why, 160);
		if (rc != bad[i].err)
			fail_msg("lookup case %zu: %s", i, ecx_err_name(rc));
	}
	/* Too many ids. */
	size_t cap = 16 + (ECX_LOOKUP_MAX_IDS + 1) * 4;
	char *many = malloc(cap);
	size_t off = (size_t)sprintf(many, "{\"ids\":[");
	for (int i = 0; i <= ECX_LOOKUP_MAX_IDS; i++)
		off += (size_t)sprintf(many + off, "%s\"a\"", i ? "," : "");
	strcpy(many + off, "]}");
	assert_int_equal(
	    ecx_lookup_req_decode(many, strlen(many), &l, why, 160),
	    ECX_ETOOBIG);
	assert_non_null(strstr(why, "at most 4096"));
	free(many);
	const char *bad_resp[] = {"{\"found\":[],\"missing\":[]}",
	                          "{\"found\":{},\"missing\":[\"x\"]}",
	                          "{\"found\":{\"x\":{}},\"missing\":[]}"};
	ecx_lookup_item one[1] = {{.id = "x"}};
	assert_int_equal(ecx_lookup_resp_decode(bad_resp[0],
	                                        strlen(bad_resp[0]), one, 1,
	                                        why, 160),
	                 ECX_EPROTO);
	assert_int_equal(ecx_lookup_resp_decode(bad_resp[1],
	                                        strlen(bad_resp[1]), one, 1,
	                                        why, 160),
	                 0);
	assert_false(one[0].found);
	assert_int_equal(ecx_lookup_resp_decode(bad_resp[2],
	                                        strlen(bad_resp[2]), one, 1,
	                                        why, 160),
	                 ECX_EPROTO);
}

/* A batch of 300 ids, every third missing, decoded into items asked in
 * another order (reversed; a found id and a missing one asked twice): each
 * gets its own entry. */
static void test_lookup_batch(void **state)
{
	(void)state;
	enum { N = 300 };
	static char ids[N][16];
	static ecx_lookup_item asked[N], back[N + 2];
	for (int i = 0; i < N; i++) {
		snprintf(ids[i], sizeof(ids[i]), "id-%03d", i);
		asked[i].id = ids[i];
		asked[i].found = i % 3 != 0;
		if (asked[i].found) {
			asked[i].entry = sample_entry();
			asked[i].entry.epoch = (uint64_t)i + 1;
		}
	}
	char *resp = ecx_lookup_resp_encode(asked, N);
	assert_non_null(resp);
	for (int i = 0; i < N; i++)
		back[i].id = ids[N - 1 - i];
	back[N].id = ids[7];     /* found, asked twice */
	back[N + 1].id = ids[6]; /* missing, asked twice */
	char why[160];
	assert_int_equal(
	    ecx_lookup_resp_decode(resp, strlen(resp), back, N + 2, why, 160),
	    0);
	for (int i = 0; i < N + 2; i++) {
		int k = i < N ? N - 1 - i : i == N ? 7 : 6;
		if (back[i].found != (k % 3 != 0))
			fail_msg("%s: found %d", back[i].id, back[i].found);
		if (back[i].found && back[i].entry.epoch != (uint64_t)k + 1)
			fail_msg("%s: epoch %llu", back[i].id,
			         (unsigned long long)back[i].entry.epoch);
	}
	ecx_lookup_items_clear(back, N + 2);
	free(resp);
}

/* The lease and age fields, and an id's several holders: kept through a
 * round trip; a reply without ecx_holders (an older registry, or one
 * holder) reads as no alternates; bad holder lists are refused. */
static void test_holders(void **state)
{
	(void)state;
	char why[160];
	ecx_entry e = sample_entry();
	e.ttl_s = 30;
	e.age_ms = 1234;
	char *s = ecx_entry_encode(&e);
	assert_non_null(strstr(s, "\"ecx_ttl_s\":30"));
	assert_non_null(strstr(s, "\"ecx_age_ms\":1234"));
	ecx_entry back;
	assert_int_equal(ecx_entry_decode(s, strlen(s), &back, why, 160), 0);
	assert_int_equal(back.ttl_s, 30);
	assert_int_equal(back.age_ms, 1234);
	free(s);
	const char *longer =
	    "{\"nbytes\":2,\"shape\":[1],\"dtype\":\"float16\","
	    "\"producer_zmq\":\"tcp://h:1\",\"ecx_ttl_s\":"
	    "86401}";
	assert_int_equal(
	    ecx_entry_decode(longer, strlen(longer), &back, why, 160),
	    ECX_EPROTO);

	ecx_lookup_item it[2] = {{.id = "a"}, {.id = "b"}};
	it[0].found = true;
	it[0].entry = sample_entry();
	ecx_entry alts[2];
	it[0].nalt = 2;
	it[0].alt = alts;
	it[0].alt[0] = sample_entry();
	ecx_strlcpy(it[0].alt[0].producer_zmq, "tcp://other:1",
	            sizeof(it[0].alt[0].producer_zmq));
	it[0].alt[1] = sample_entry();
	ecx_strlcpy(it[0].alt[1].producer_zmq, "tcp://third:1",
	            sizeof(it[0].alt[1].producer_zmq));
	it[1].found = true;
	it[1].entry = sample_entry();
	char *resp = ecx_lookup_resp_encode(it, 2);
	assert_non_null(strstr(resp, "\"ecx_holders\""));
	ecx_lookup_item b[2] = {{.id = "a"}, {.id = "b"}};
	assert_int_equal(
	    ecx_lookup_resp_decode(resp, strlen(resp), b, 2, why, 160), 0);
	assert_true(b[0].found && b[1].found);
	assert_int_equal(b[0].nalt, 2);
	assert_string_equal(b[0].alt[0].producer_zmq, "tcp://other:1");
	assert_string_equal(b[0].alt[1].producer_zmq, "tcp://third:1");
	assert_int_equal(b[1].nalt, 0);
	ecx_lookup_items_clear(b, 2);
	free(resp);
	/* Holders that are not an array of entries. */
	const char *bad = "{\"found\":{},\"missing\":[\"a\"],"
	                  "\"ecx_holders\":{\"a\":{}}}";
	ecx_lookup_item one[1] = {{.id = "a"}};
	assert_int_equal(
	    ecx_lookup_resp_decode(bad, strlen(bad), one, 1, why, 160),
	    ECX_EPROTO);
}

/* cJSON's own printing of what cJSON parses of s: equal to s when s is
 * written exactly as cJSON_PrintUnformatted writes it. */
static void assert_cjson_bytes(const char *s)
{
	cJSON *o = cJSON_Parse(s);
	assert_non_null(o);
	char *p = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	if (strcmp(p, s) != 0)
		fail_msg("not cJSON's bytes:\n  ours  %s\n  cJSON %s", s, p);
	free(p);
}

/* The direct writer prints what the tree codec printed: the same bytes
 * for every field, escapes included, and reads them back. */
static void test_entry_bytes(void **state)
{
	(void)state;
	static const char *const producers[] = {
	    "tcp://10.0.0.2:5555", "q\"b\\s/\n\r\t\b\f\x01\x1f\x7f",
	    "\xc3\xa9t\xc3\xa9 \xf0\x9f\x98\x80"};
	for (size_t k = 0; k < 3; k++)
		for (uint32_t nd = 0; nd <= ECX_MAX_DIMS; nd++) {
			ecx_entry e = sample_entry(), back;
			uint64_t shape[ECX_MAX_DIMS];
			for (uint32_t i = 0; i < nd; i++)
				shape[i] = i == 0 ? 1369 : 2;
			assert_int_equal(ecx_tensor_set(&e.desc,
			                                ECX_DTYPE_FLOAT32, nd,
			                                shape),
			                 0);
			memset(e.producer_zmq, 0, sizeof(e.producer_zmq));
			strcpy(e.producer_zmq, producers[k]);
			e.epoch = nd % 4 == 1   ? ECX_JSON_INT_MAX - 1
			          : nd % 4 == 3 ? 123456789012345ull
			                        : 0;
			e.ttl_s = nd % 3 ? 30 : 0;
			e.age_ms = nd;
			char *s = ecx_entry_encode(&e);
			cJSON *t = ecx_entry_to_json(&e);
			char *ref = cJSON_PrintUnformatted(t);
			cJSON_Delete(t);
			assert_string_equal(s, ref);
			/* cJSON prints numbers of 16 digits or more
			 * rounded (ecx writes them as raw digits). */
			if (e.epoch < 1000000000000000ull)
				assert_cjson_bytes(s);
			char why[160];
			assert_int_equal(
			    ecx_entry_decode(s, strlen(s), &back, why, 160), 0);
			assert_memory_equal(&back, &e, sizeof(e));
			free(ref);
			free(s);
		}
	/* A batched answer: found, missing and holders, with an id asked
	 * twice, exactly as the tree codec laid it out. */
	ecx_lookup_item it[4] = {
	    {.id = "a"}, {.id = "m"}, {.id = "a"}, {.id = "b"}};
	ecx_entry alt = sample_entry();
	strcpy(alt.producer_zmq, "tcp://other:1");
	it[0].found = it[2].found = it[3].found = true;
	it[0].entry = it[2].entry = it[3].entry = sample_entry();
	it[3].nalt = 1;
	it[3].alt = &alt;
	char *resp = ecx_lookup_resp_encode(it, 4);
	const char *e1 = "{\"nbytes\":9812992,\"shape\":[1369,3584],"
	                 "\"dtype\":\"bfloat16\",\"producer_zmq\":"
	                 "\"tcp://10.0.0.2:5555\",\"ecx_epoch\":77}";
	const char *e2 = "{\"nbytes\":9812992,\"shape\":[1369,3584],"
	                 "\"dtype\":\"bfloat16\",\"producer_zmq\":"
	                 "\"tcp://other:1\",\"ecx_epoch\":77}";
	char want[1024];
	snprintf(want, sizeof(want),
	         "{\"found\":{\"a\":%s,\"b\":%s},\"missing\":[\"m\"],"
	         "\"ecx_holders\":{\"b\":[%s,%s]}}",
	         e1, e1, e1, e2);
	assert_string_equal(resp, want);
	free(resp);
	ecx_lookup_item none[1] = {{.id = "z"}};
	resp = ecx_lookup_resp_encode(none, 1);
	assert_string_equal(resp, "{\"found\":{},\"missing\":[\"z\"]}");
	free(resp);
	const char *ids[] = {"a", "b:c"};
	char *req = ecx_lookup_req_encode(ids, 2);
	assert_string_equal(req, "{\"ids\":[\"a\",\"b:c\"]}");
	free(req);
	req = ecx_lookup_req_encode(ids, 0);
	assert_string_equal(req, "{\"ids\":[]}");
	free(req);
}

/* The reader without a tree: what JSON allows reads as cJSON reads it
 * (spacing, escapes, unknown and nested fields, the first of a repeated
 * key, a byte order mark); what the RFC refuses is refused. */
static void test_reader(void **state)
{
	(void)state;
	char why[160];
	ecx_entry e;
	const char *ok =
	    "\xEF\xBB\xBF \t\r\n{ \"n\\u0062ytes\" : 2 , \"future\": {\"a\": "
	    "[1, -2.5e+3, true, false, null, {\"b\": []}]}, \"shape\":[ 1 ],"
	    "\"dtype\":\"fl\\u006fat16\", \"producer_zmq\":"
	    "\"t\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00\","
	    "\"nbytes\": 999, \"ecx_epoch\": 1.0e1 }\n\0";
	assert_int_equal(ecx_entry_decode(ok, strlen(ok) + 1, &e, why, 160), 0);
	assert_int_equal(e.desc.nbytes, 2);
	assert_int_equal(e.desc.dtype, ECX_DTYPE_FLOAT16);
	assert_int_equal(e.epoch, 10);
	assert_string_equal(e.producer_zmq,
	                    "t\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80");
	/* A key longer than any field's name, with escapes after the
	 * longest name's length: skipped (once looped for ever). */
	char longkey[256];
	snprintf(longkey, sizeof(longkey),
	         "{\"%070d\\\\\\bx\": 1, \"nbytes\":1,\"shape\":[1],"
	         "\"dtype\":\"uint8\",\"producer_zmq\":\"a\"}",
	         0);
	assert_int_equal(
	    ecx_entry_decode(longkey, strlen(longkey), &e, why, 160), 0);
	static const char *const bad[] = {
	    "{\"nbytes\":01,\"shape\":[1],\"dtype\":\"uint8\","
	    "\"producer_zmq\":\"a\"}",
	    "{\"nbytes\":1.,\"shape\":[1],\"dtype\":\"uint8\","
	    "\"producer_zmq\":\"a\"}",
	    "{\"nbytes\":1,\"shape\":[1],\"dtype\":\"uint8\","
	    "\"producer_zmq\":\"a\x01\"}",
	    "{\"nbytes\":1,\"shape\":[1],\"dtype\":\"uint8\","
	    "\"producer_zmq\":\"a\\u0000b\"}",
	    "{\"nbytes\":1,\"shape\":[1],\"dtype\":\"uint8\","
	    "\"producer_zmq\":\"a\\udc00\"}",
	    "{\"nbytes\":1,\"shape\":[1],\"dtype\":\"uint8\","
	    "\"producer_zmq\":\"a\\ud800x\"}",
	    "{\"nbytes\":1,\"shape\":[1],\"dtype\":\"uint8\","
	    "\"producer_zmq\":\"a\\uZZZZ\"}",
	    "{\"nbytes\":1,\"shape\":[1],\"dtype\":\"uint8\","
	    "\"producer_zmq\":\"a\\x\"}",
	    "{\"nbytes\":1,\"shape\":[1,],\"dtype\":\"uint8\","
	    "\"producer_zmq\":\"a\"}",
	    "{\"nbytes\":1,,\"shape\":[1],\"dtype\":\"uint8\","
	    "\"producer_zmq\":\"a\"}",
	    "{\"nbytes\" 1}",
	    "{\"nbytes\":tru}",
	    "{nbytes:1}",
	    "{\"nbytes\":1}}",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		if (ecx_entry_decode(bad[i], strlen(bad[i]), &e, why, 160) !=
		    ECX_EPROTO)
			fail_msg("accepted %s", bad[i]);
	/* Nesting: 999 levels inside the object are read, 1000 refused. */
	for (int depth = 999; depth <= 1000; depth++) {
		size_t n = 2 * (size_t)depth + 64;
		char *deep = malloc(n);
		int off = sprintf(deep, "{\"x\":");
		for (int i = 0; i < depth; i++)
			deep[off++] = '[';
		for (int i = 0; i < depth; i++)
			deep[off++] = ']';
		strcpy(deep + off, "}");
		ecx_idlist l;
		int rc =
		    ecx_lookup_req_decode(deep, strlen(deep), &l, why, 160);
		assert_int_equal(rc, ECX_EPROTO);
		assert_non_null(
		    strstr(why, depth < 1000 ? "missing field" : "not valid"));
		free(deep);
	}
}

/* The pull as the tree codec wrote it before it was written without a
 * tree (ecx_json_u64 nodes printed by cJSON_PrintUnformatted): the
 * reference the writer's bytes must equal. */
static char *ref_pull_req(const ecx_pull_req *r)
{
	static const char *const hn[] = {"", "none", "xxh64", "xxh3"};
	cJSON *o = cJSON_CreateObject();
	cJSON_AddStringToObject(o, "op", "pullv");
	cJSON_AddItemToObject(o, "req", ecx_json_u64(r->req));
	if (r->expires_ms != 0)
		cJSON_AddItemToObject(o, "expires_ms",
		                      ecx_json_u64(r->expires_ms));
	if (r->data_am)
		cJSON_AddStringToObject(o, "data", "am");
	if (r->hash >= ECX_HASH_NONE && r->hash <= ECX_HASH_XXH3)
		cJSON_AddStringToObject(o, "hash", hn[r->hash]);
	if (r->landed)
		cJSON_AddBoolToObject(o, "landed", true);
	if (r->fold)
		cJSON_AddStringToObject(o, "reply", "data");
	if (r->fold && r->lead)
		cJSON_AddBoolToObject(o, "lead", true);
	if (r->token[0] != '\0')
		cJSON_AddStringToObject(o, "token", r->token);
	cJSON *regs = cJSON_AddArrayToObject(o, "regions");
	cJSON *items = cJSON_AddArrayToObject(o, "items");
	for (size_t i = 0; i < r->nregions; i++) {
		const ecx_region *g = &r->regions[i];
		cJSON *x = cJSON_CreateObject();
		cJSON_AddItemToArray(regs, x);
		char b64[256];
		ecx_b64_encode(g->rkey, g->rkey_len, b64);
		cJSON_AddItemToObject(x, "base", ecx_json_u64(g->base));
		cJSON_AddItemToObject(x, "len", ecx_json_u64(g->len));
		cJSON_AddStringToObject(x, "rkey", b64);
	}
	for (size_t i = 0; i < r->nitems; i++) {
		const ecx_pull_item *it = &r->items[i];
		cJSON *x = cJSON_CreateObject();
		cJSON_AddItemToArray(items, x);
		cJSON_AddStringToObject(x, "id", it->id);
		cJSON_AddItemToObject(x, "nbytes", ecx_json_u64(it->nbytes));
		cJSON_AddItemToObject(x, "region", ecx_json_u64(it->region));
		cJSON_AddItemToObject(x, "addr", ecx_json_u64(it->addr));
		if (it->lease != 0)
			cJSON_AddItemToObject(x, "lease",
			                      ecx_json_u64(it->lease));
	}
	char *s = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	return s;
}

/* The reply as the tree codec wrote it (see ref_pull_req). */
static char *ref_pull_resp(const ecx_pull_resp *r)
{
	cJSON *o = cJSON_CreateObject();
	cJSON_AddItemToObject(o, "req", ecx_json_u64(r->req));
	if (r->err != 0) {
		cJSON_AddBoolToObject(o, "ok", false);
		cJSON_AddStringToObject(
		    o, "err",
		    r->detail[0] != '\0' ? r->detail : core_strerror(r->err));
		cJSON_AddStringToObject(o, "code", core_err_name(r->err));
	} else {
		cJSON_AddBoolToObject(o, "ok", true);
		if (r->data_am)
			cJSON_AddStringToObject(o, "data", "am");
		cJSON *items = cJSON_AddArrayToObject(o, "items");
		const char *hname =
		    r->hash_kind == ECX_HASH_XXH3 ? "xxh3" : "xxh64";
		for (size_t i = 0; i < r->nitems; i++) {
			cJSON *x = cJSON_CreateObject();
			cJSON_AddItemToArray(items, x);
			cJSON_AddBoolToObject(x, "ok", r->status[i] == 0);
			if (r->status[i] == 0 && r->hash != NULL &&
			    (r->has_hash == NULL || r->has_hash[i])) {
				char hex[17];
				snprintf(hex, sizeof(hex), "%016llx",
				         (unsigned long long)r->hash[i]);
				cJSON_AddStringToObject(x, hname, hex);
			}
			if (r->status[i] != 0) {
				cJSON_AddStringToObject(
				    x, "err", core_strerror(r->status[i]));
				cJSON_AddStringToObject(
				    x, "code", core_err_name(r->status[i]));
			}
		}
	}
	char *s = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	return s;
}

/* The pull and its reply are written without a tree: the bytes the tree
 * codec wrote for the same values, field by field, escapes included, in
 * every combination of what is sent or left out; and they read back. */
static void test_pull_bytes(void **state)
{
	(void)state;
	unsigned char rkey[] = {0, 1, 2, 250, 251, 252, 253, 254, 255};
	ecx_region regs[2] = {{4096, 1 << 20, sizeof(rkey), rkey},
	                      {139637976727552ull, 4096, 1, rkey}};
	ecx_pull_item items[3];
	memset(items, 0, sizeof(items));
	strcpy(items[0].id, ID64);
	items[0].nbytes = 1000;
	items[0].addr = 8192;
	strcpy(items[1].id, "q\"b\\s/\n\x01");
	items[1].nbytes = 4000;
	items[1].region = 1;
	items[1].addr = 139637976727553ull;
	items[1].lease = 77;
	strcpy(items[2].id, "\xc3\xa9t\xc3\xa9");
	items[2].nbytes = 3;
	items[2].addr = 4097;
	items[2].lease = 1ull << 52;
	for (int m = 0; m < 64; m++) {
		ecx_pull_req r = {.req = m == 0 ? 0 : 123456789012345ull / m,
		                  .expires_ms = m & 1 ? 1764521000123ull : 0,
		                  .data_am = m & 2,
		                  .hash = m % 5 - 1, /* -1 and 4: not sent */
		                  .landed = m & 4,
		                  .fold = m & 8,
		                  .lead = m & 16,
		                  .nregions = (size_t)m % 3,
		                  .regions = regs,
		                  .nitems = m % 3 == 0 ? 0 : (size_t)m % 4,
		                  .items = items};
		if (m & 32)
			strcpy(r.token, "s3\"c\\ret\t\x7f");
		char *s = ecx_pull_req_encode(&r), *ref = ref_pull_req(&r);
		assert_non_null(s);
		assert_string_equal(s, ref);
		free(ref);
		ecx_pull_req b;
		char why[160];
		/* Read back where ids are ids (the others test escapes) and
		 * items lie in their regions. */
		if (r.nitems == 0 || (r.nitems == 1 && r.nregions >= 1)) {
			assert_int_equal(
			    ecx_pull_req_decode(s, strlen(s), &b, why, 160), 0);
			assert_true(b.req == r.req &&
			            b.expires_ms == r.expires_ms);
			assert_int_equal(b.nitems, r.nitems);
			for (size_t i = 0; i < r.nitems; i++)
				assert_memory_equal(&b.items[i], &items[i],
				                    sizeof(items[i]));
			assert_string_equal(b.token, r.token);
			ecx_pull_req_free(&b);
		}
		free(s);
	}
	int st[4] = {0, ECX_ENOTFOUND, 0, ECX_ESIZE};
	uint64_t h[4] = {0xfedcba9876543219ull, 1, 0x0123456789abcdefull, 0xa5};
	unsigned char has[4] = {1, 0, 0, 1};
	for (int m = 0; m < 32; m++) {
		ecx_pull_resp p = {.req = 42 + (uint64_t)m,
		                   .data_am = m & 1,
		                   .nitems = (size_t)m % 5,
		                   .status = st,
		                   .hash = m & 2 ? h : NULL,
		                   .has_hash = m & 4 ? has : NULL,
		                   .hash_kind = m & 8 ? ECX_HASH_XXH3 : 0};
		if (m == 31) {
			p.err = ECX_EAUTH;
			strcpy(p.detail, "bad \"token\"\n");
		} else if (m == 30) {
			p.err = ECX_EPROTO;
		} else if (m == 29) {
			p.err = 12345; /* no name: "EIO"'s words */
		}
		char *s = ecx_pull_resp_encode(&p), *ref = ref_pull_resp(&p);
		assert_non_null(s);
		assert_string_equal(s, ref);
		free(ref);
		ecx_pull_resp b;
		char why[160];
		assert_int_equal(
		    ecx_pull_resp_decode(s, strlen(s), &b, why, 160), 0);
		if (p.err != 0) {
			assert_string_equal(b.detail,
			                    p.detail[0] != '\0'
			                        ? p.detail
			                        : core_strerror(p.err));
			ecx_pull_resp_free(&b);
			free(s);
			continue;
		}
		assert_int_equal(b.nitems, p.nitems);
		for (size_t i = 0; i < p.nitems; i++) {
			assert_int_equal(b.status[i], st[i]);
			bool sent = st[i] == 0 && p.hash != NULL &&
			            (p.has_hash == NULL || p.has_hash[i]);
			assert_int_equal(b.has_hash != NULL && b.has_hash[i],
			                 sent);
			if (sent)
				assert_true(b.hash[i] == h[i]);
		}
		ecx_pull_resp_free(&b);
		free(s);
	}
}

static void test_pull_roundtrip(void **state)
{
	(void)state;
	unsigned char rkey[] = {1, 2, 3, 4, 5, 250};
	ecx_region regs[2] = {{4096, 1 << 20, sizeof(rkey), rkey},
	                      {1 << 30, 4096, 3, rkey}};
	ecx_pull_item items[2];
	memset(items, 0, sizeof(items));
	strcpy(items[0].id, ID64);
	items[0].nbytes = 1000;
	items[0].region = 0;
	items[0].addr = 8192;
	strcpy(items[1].id, "b");
	items[1].nbytes = 4096;
	items[1].region = 1;
	items[1].addr = 1 << 30;
	ecx_pull_req r = {.req = 42,
	                  .expires_ms = 1764521000123ull,
	                  .nregions = 2,
	                  .regions = regs,
	                  .nitems = 2,
	                  .items = items};
	strcpy(r.token, "s3cret");
	char *s = ecx_pull_req_encode(&r);
	assert_non_null(s);
	ecx_pull_req b;
	char why[160];
	assert_int_equal(ecx_pull_req_decode(s, strlen(s), &b, why, 160), 0);
	assert_int_equal(b.req, 42);
	assert_int_equal(b.expires_ms, 1764521000123ull);
	assert_string_equal(b.token, "s3cret");
	assert_int_equal(b.nregions, 2);
	assert_int_equal(b.regions[0].rkey_len, sizeof(rkey));
	assert_memory_equal(b.regions[0].rkey, rkey, sizeof(rkey));
	assert_int_equal(b.regions[1].rkey_len, 3);
	assert_int_equal(b.nitems, 2);
	assert_memory_equal(&b.items[0], &items[0], sizeof(items[0]));
	assert_memory_equal(&b.items[1], &items[1], sizeof(items[1]));
	assert_false(b.data_am); /* not asked: puts */
	ecx_pull_req_free(&b);
	free(s);
	/* Asking for the data as active messages survives the round trip;
	 * a way the producer does not know reads as puts. */
	r.data_am = true;
	s = ecx_pull_req_encode(&r);
	assert_non_null(strstr(s, "\"data\":\"am\""));
	assert_int_equal(ecx_pull_req_decode(s, strlen(s), &b, why, 160), 0);
	assert_true(b.data_am);
	ecx_pull_req_free(&b);
	char *at = strstr(s, "\"am\"");
	memcpy(at, "\"xy\"", 4);
	assert_int_equal(ecx_pull_req_decode(s, strlen(s), &b, why, 160), 0);
	assert_false(b.data_am);
	ecx_pull_req_free(&b);
	free(s);
	r.data_am = false;
	/* The hash a consumer checks: not said (an older consumer) reads as
	 * DEFAULT, each named kind survives the round trip, a name this
	 * producer does not know reads as DEFAULT (it answers xxh64). */
	const char *older = "{\"op\":\"pullv\",\"req\":1,\"regions\":[],"
	                    "\"items\":[]}";
	assert_int_equal(
	    ecx_pull_req_decode(older, strlen(older), &b, why, 160), 0);
	assert_int_equal(b.hash, ECX_HASH_DEFAULT);
	assert_false(b.landed);
	ecx_pull_req_free(&b);
	static const struct {
		int kind;
		const char *field;
	} kinds[] = {{ECX_HASH_NONE, "\"hash\":\"none\""},
	             {ECX_HASH_XXH64, "\"hash\":\"xxh64\""},
	             {ECX_HASH_XXH3, "\"hash\":\"xxh3\""}};
	for (size_t k = 0; k < 3; k++) {
		r.hash = kinds[k].kind;
		r.landed = k == 2;
		s = ecx_pull_req_encode(&r);
		assert_non_null(strstr(s, kinds[k].field));
		assert_true((strstr(s, "\"landed\":true") != NULL) == r.landed);
		assert_int_equal(
		    ecx_pull_req_decode(s, strlen(s), &b, why, 160), 0);
		assert_int_equal(b.hash, kinds[k].kind);
		assert_int_equal(b.landed, r.landed);
		ecx_pull_req_free(&b);
		free(s);
	}
	const char *later = "{\"op\":\"pullv\",\"req\":1,\"hash\":\"xxh128\","
	                    "\"landed\":1,\"regions\":[],\"items\":[]}";
	assert_int_equal(
	    ecx_pull_req_decode(later, strlen(later), &b, why, 160), 0);
	assert_int_equal(b.hash, ECX_HASH_DEFAULT);
	assert_false(b.landed); /* only true is true */
	ecx_pull_req_free(&b);
	/* "lead" goes with "reply": "data" only, and reads back only with it
	 * and as true; an older pull (without it) reads as no lead. */
	r.data_am = r.fold = r.lead = true;
	s = ecx_pull_req_encode(&r);
	assert_non_null(strstr(s, "\"lead\":true"));
	assert_int_equal(ecx_pull_req_decode(s, strlen(s), &b, why, 160), 0);
	assert_true(b.fold && b.lead);
	ecx_pull_req_free(&b);
	free(s);
	r.fold = false;
	s = ecx_pull_req_encode(&r);
	assert_null(strstr(s, "\"lead\""));
	free(s);
	r.data_am = r.lead = false;
	const char *nofold = "{\"op\":\"pullv\",\"req\":1,\"data\":\"am\","
	                     "\"lead\":true,\"regions\":[],\"items\":[]}";
	assert_int_equal(
	    ecx_pull_req_decode(nofold, strlen(nofold), &b, why, 160), 0);
	assert_false(b.lead); /* no fold: no lead */
	ecx_pull_req_free(&b);
	assert_int_equal(
	    ecx_pull_req_decode(older, strlen(older), &b, why, 160), 0);
	assert_false(b.lead);
	ecx_pull_req_free(&b);
	r.hash = ECX_HASH_DEFAULT;
	r.landed = false;
	s = ecx_pull_req_encode(&r);
	assert_null(strstr(s, "\"hash\""));
	assert_null(strstr(s, "\"landed\""));
	free(s);

	int st[3] = {0, ECX_ENOTFOUND, ECX_ESIZE};
	ecx_pull_resp p = {.req = 42, .nitems = 3, .status = st};
	s = ecx_pull_resp_encode(&p);
	assert_non_null(strstr(s, "\"err\":\"unknown mm_hash\""));
	ecx_pull_resp pb;
	assert_int_equal(ecx_pull_resp_decode(s, strlen(s), &pb, why, 160), 0);
	assert_int_equal(pb.req, 42);
	assert_int_equal(pb.nitems, 3);
	assert_memory_equal(pb.status, st, sizeof(st));
	assert_null(pb.hash);     /* a producer without integrity sends none */
	assert_false(pb.data_am); /* nor says how the data went: puts */
	ecx_pull_resp_free(&pb);
	free(s);
	p.data_am = true;
	s = ecx_pull_resp_encode(&p);
	assert_int_equal(ecx_pull_resp_decode(s, strlen(s), &pb, why, 160), 0);
	assert_true(pb.data_am);
	ecx_pull_resp_free(&pb);
	free(s);
	p.data_am = false;
	/* Hashes travel on the items that succeeded, all 64 bits of them. */
	uint64_t h[3] = {0xfedcba9876543210ull, 1, 2};
	p.hash = h;
	s = ecx_pull_resp_encode(&p);
	assert_non_null(strstr(s, "\"xxh64\":\"fedcba9876543210\""));
	assert_null(strstr(s, "0000000000000001"));
	assert_int_equal(ecx_pull_resp_decode(s, strlen(s), &pb, why, 160), 0);
	assert_non_null(pb.hash);
	assert_int_equal(pb.has_hash[0], 1);
	assert_int_equal(pb.has_hash[1], 0);
	assert_true(pb.hash[0] == h[0]);
	assert_int_equal(pb.hash_kind, ECX_HASH_XXH64);
	ecx_pull_resp_free(&pb);
	free(s);
	/* XXH3, for a pull that asked for it: its own field, and "xxh64"
	 * keeps meaning xxh64. */
	p.hash_kind = ECX_HASH_XXH3;
	s = ecx_pull_resp_encode(&p);
	assert_non_null(strstr(s, "\"xxh3\":\"fedcba9876543210\""));
	assert_null(strstr(s, "\"xxh64\""));
	assert_int_equal(ecx_pull_resp_decode(s, strlen(s), &pb, why, 160), 0);
	assert_int_equal(pb.hash_kind, ECX_HASH_XXH3);
	assert_int_equal(pb.has_hash[0], 1);
	assert_int_equal(pb.has_hash[1], 0);
	assert_true(pb.hash[0] == h[0]);
	ecx_pull_resp_free(&pb);
	free(s);
	p.hash = NULL;
	p.hash_kind = 0;
	/* A fixture as a producer of either kind sends it. */
	const char *x3 = "{\"req\":9,\"ok\":true,\"items\":[{\"ok\":true,"
	                 "\"xxh3\":\"00000000000000ff\"},{\"ok\":true}]}";
	assert_int_equal(ecx_pull_resp_decode(x3, strlen(x3), &pb, why, 160),
	                 0);
	assert_int_equal(pb.hash_kind, ECX_HASH_XXH3);
	assert_true(pb.hash[0] == 0xff && pb.has_hash[0] && !pb.has_hash[1]);
	ecx_pull_resp_free(&pb);
	/* One kind per reply, one hash per item. */
	const char *mixed[] = {
	    "{\"req\":1,\"ok\":true,\"items\":[{\"ok\":true,\"xxh3\":"
	    "\"0000000000000001\"},{\"ok\":true,\"xxh64\":"
	    "\"0000000000000002\"}]}",
	    "{\"req\":1,\"ok\":true,\"items\":[{\"ok\":true,\"xxh3\":"
	    "\"0000000000000001\",\"xxh64\":\"0000000000000002\"}]}",
	    "{\"req\":1,\"ok\":true,\"items\":[{\"ok\":true,\"xxh3\":7}]}"};
	for (size_t k = 0; k < 3; k++)
		assert_int_equal(ecx_pull_resp_decode(
		                     mixed[k], strlen(mixed[k]), &pb, why, 160),
		                 ECX_EPROTO);
	/* The hashes themselves: XXH64 seed 0 and XXH3_64bits of "abc"
	 * (xxHash's own published values), and nothing for other kinds. */
	assert_true(ecx_hash_bytes(ECX_HASH_XXH64, "abc", 3) ==
	            0x44bc2cf5ad770999ull);
	assert_true(ecx_hash_bytes(ECX_HASH_XXH3, "abc", 3) ==
	            0x78af5f94892f3950ull);
	assert_true(ecx_hash_bytes(ECX_HASH_NONE, "abc", 3) == 0);
	assert_string_equal(ecx_hash_name(ECX_HASH_XXH3), "xxh3");
	assert_null(ecx_hash_name(ECX_HASH_NONE));
	const char *bad = "{\"req\":1,\"ok\":true,\"items\":[{\"ok\":true,"
	                  "\"xxh64\":\"12345678zz345678\"}]}";
	assert_int_equal(ecx_pull_resp_decode(bad, strlen(bad), &pb, why, 160),
	                 ECX_EPROTO);
	ecx_pull_resp whole = {.req = 7, .err = ECX_EAUTH};
	s = ecx_pull_resp_encode(&whole);
	assert_int_equal(ecx_pull_resp_decode(s, strlen(s), &pb, why, 160), 0);
	assert_int_equal(pb.err, ECX_EAUTH);
	assert_int_equal(pb.nitems, 0);
	assert_null(pb.status);
	free(s);
}

static void test_pull_rejects(void **state)
{
	(void)state;
#define REG "\"regions\":[{\"base\":4096,\"len\":4096,\"rkey\":\"AQID\"}]"
	static const struct {
		const char *json;
		int err;
		const char *why;
	} bad[] = {
	    {"{\"op\":\"push\",\"req\":1," REG ",\"items\":[]}",
	     ECX_EUNSUPPORTED, "unknown op"},
	    {"{\"op\":\"pullv\"," REG ",\"items\":[]}", ECX_EPROTO, "\"req\""},
	    {"{\"op\":\"pullv\",\"req\":1,\"items\":[]}", ECX_EPROTO, "arrays"},
	    {"{\"op\":\"pullv\",\"req\":1," REG
	     ",\"items\":[{\"id\":\"a\",\"nbytes\":10,\"region\":1,"
	     "\"addr\":4096}]}",
	     ECX_EPROTO, "region 1 of 1"},
	    {"{\"op\":\"pullv\",\"req\":1," REG
	     ",\"items\":[{\"id\":\"a\",\"nbytes\":10,\"region\":0,"
	     "\"addr\":8190}]}",
	     ECX_EPROTO, "outside"},
	    {"{\"op\":\"pullv\",\"req\":1," REG
	     ",\"items\":[{\"id\":\"a\",\"nbytes\":10,\"region\":0,"
	     "\"addr\":100}]}",
	     ECX_EPROTO, "outside"},
	    {"{\"op\":\"pullv\",\"req\":1," REG
	     ",\"items\":[{\"id\":\"a\",\"nbytes\":9999,\"region\":0,"
	     "\"addr\":4096}]}",
	     ECX_EPROTO, "outside"},
	    {"{\"op\":\"pullv\",\"req\":1," REG
	     ",\"items\":[{\"id\":\"a b\",\"nbytes\":1,\"region\":0,"
	     "\"addr\":4096}]}",
	     ECX_EID, "0x20"},
	    {"{\"op\":\"pullv\",\"req\":1," REG
	     ",\"items\":[{\"id\":\"a\",\"nbytes\":-1,\"region\":0,"
	     "\"addr\":4096}]}",
	     ECX_EPROTO, "negative"},
	    {"{\"op\":\"pullv\",\"req\":1,\"regions\":[{\"base\":1,\"len\":0,"
	     "\"rkey\":\"AQID\"}],\"items\":[]}",
	     ECX_EPROTO, "empty"},
	    {"{\"op\":\"pullv\",\"req\":1,\"regions\":[{\"base\":1,\"len\":5,"
	     "\"rkey\":\"!!!!\"}],\"items\":[]}",
	     ECX_EPROTO, "base64"},
	    {"{\"op\":\"pullv\",\"req\":1,\"regions\":[{\"base\":1,\"len\":5,"
	     "\"rkey\":7}],\"items\":[]}",
	     ECX_EPROTO, "not a string"},
	    {"{\"op\":\"pullv\",\"req\":1,\"token\":5," REG ",\"items\":[]}",
	     ECX_EPROTO, "token"},
	    {"{\"op\":\"pullv\",\"req\":1," REG ",\"items\":[7]}", ECX_EPROTO,
	     "not an object"},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char why[160] = "";
		ecx_pull_req r;
		int rc = ecx_pull_req_decode(bad[i].json, strlen(bad[i].json),
		                             &r, why, 160);
		if (rc != bad[i].err || strstr(why, bad[i].why) == NULL)
			fail_msg("pull case %zu: got %s \"%s\"", i,
			         ecx_err_name(rc), why);
	}
	const char *bad_resp[] = {"{\"ok\":true,\"items\":[]}",
	                          "{\"req\":1,\"items\":[]}",
	                          "{\"req\":1,\"ok\":true}",
	                          "{\"req\":1,\"ok\":true,\"items\":[{}]}"};
	for (size_t i = 0; i < 4; i++) {
		ecx_pull_resp p;
		char why[160];
		assert_int_equal(ecx_pull_resp_decode(bad_resp[i],
		                                      strlen(bad_resp[i]), &p,
		                                      why, 160),
		                 ECX_EPROTO);
	}
	/* An unknown code on the wire is a failure, never success. */
	const char *odd = "{\"req\":1,\"ok\":true,\"items\":[{\"ok\":false,"
	                  "\"code\":\"OK\"}]}";
	ecx_pull_resp p;
	char why[160];
	assert_int_equal(ecx_pull_resp_decode(odd, strlen(odd), &p, why, 160),
	                 0);
	assert_int_equal(p.status[0], ECX_EIO);
	ecx_pull_resp_free(&p);
}

static void test_zmsg(void **state)
{
	(void)state;
	unsigned char w[100];
	for (int i = 0; i < 100; i++)
		w[i] = (unsigned char)(i * 7);
	char *s = ecx_zreq_encode_hello(w, sizeof(w), "tok",
	                                ECX_TR_SHM | ECX_TR_TCP, "boot/ipc/0");
	ecx_zreq r;
	char why[160];
	assert_int_equal(ecx_zreq_decode(s, strlen(s), &r, why, 160), 0);
	assert_int_equal(r.op, ECX_ZOP_HELLO);
	assert_string_equal(r.token, "tok");
	assert_int_equal(r.worker_len, sizeof(w));
	assert_memory_equal(r.worker, w, sizeof(w));
	assert_int_equal(r.transports, ECX_TR_SHM | ECX_TR_TCP);
	assert_string_equal(r.domain, "boot/ipc/0");
	ecx_zreq_free(&r);
	free(s);
	/* An older consumer says neither; a newer one may name transports
	 * this side does not know, which are skipped. */
	s = ecx_zreq_encode_hello(w, sizeof(w), NULL, 0, NULL);
	assert_null(strstr(s, "transports"));
	assert_int_equal(ecx_zreq_decode(s, strlen(s), &r, why, 160), 0);
	assert_int_equal(r.transports, 0);
	assert_string_equal(r.domain, "");
	ecx_zreq_free(&r);
	free(s);
	const char *newer = "{\"op\":\"hello\",\"worker\":\"AAAA\","
	                    "\"transports\":[\"rdma\",\"tcp\"]}";
	assert_int_equal(ecx_zreq_decode(newer, strlen(newer), &r, why, 160),
	                 0);
	assert_int_equal(r.transports, ECX_TR_TCP);
	ecx_zreq_free(&r);

	s = ecx_zreq_encode_pull(ID64, "10.0.0.3:17000", 140737488355328ull,
	                         7340032);
	assert_int_equal(ecx_zreq_decode(s, strlen(s), &r, why, 160), 0);
	assert_int_equal(r.op, ECX_ZOP_PULL);
	assert_string_equal(r.mm_hash, ID64);
	assert_string_equal(r.dst_session, "10.0.0.3:17000");
	assert_int_equal(r.dst_ptr, 140737488355328ull);
	assert_int_equal(r.nbytes, 7340032);
	free(s);
	/* The goodbye: the connection and the producer's epoch. */
	s = ecx_zreq_encode_bye(42, 1ull << 52, "tok");
	assert_int_equal(ecx_zreq_decode(s, strlen(s), &r, why, 160), 0);
	assert_int_equal(r.op, ECX_ZOP_BYE);
	assert_int_equal(r.conn, 42);
	assert_int_equal(r.epoch, 1ull << 52);
	assert_string_equal(r.token, "tok");
	free(s);
	ecx_zresp zb;
	s = ecx_zresp_encode_bye(true);
	assert_int_equal(ecx_zresp_decode(s, strlen(s), &zb, why, 160), 0);
	assert_true(zb.ok);
	assert_true(zb.closed);
	free(s);
	s = ecx_zresp_encode_bye(false);
	assert_int_equal(ecx_zresp_decode(s, strlen(s), &zb, why, 160), 0);
	assert_false(zb.closed);
	free(s);
	/* The reference's own encoding (Python json.dumps). */
	const char *py = "{\"op\": \"pull\", \"mm_hash\": \"abc\", "
	                 "\"dst_session\": \"h:1\", \"dst_ptr\": 1234, "
	                 "\"nbytes\": 8}";
	assert_int_equal(ecx_zreq_decode(py, strlen(py), &r, why, 160), 0);

	static const struct {
		const char *json;
		int err;
	} bad[] = {
	    {"{\"op\":\"push\"}", ECX_EUNSUPPORTED},
	    {"{}", ECX_EUNSUPPORTED},
	    {"{\"op\":3}", ECX_EUNSUPPORTED},
	    {"{\"op\":\"hello\"}", ECX_EPROTO},
	    {"{\"op\":\"bye\",\"conn\":1}", ECX_EPROTO},
	    {"{\"op\":\"bye\",\"conn\":-1,\"epoch\":1}", ECX_EPROTO},
	    {"{\"op\":\"hello\",\"worker\":\"@@@@\"}", ECX_EPROTO},
	    {"{\"op\":\"hello\",\"worker\":\"AAAA\",\"transports\":\"tcp\"}",
	     ECX_EPROTO},
	    {"{\"op\":\"pull\",\"dst_session\":\"a\",\"dst_ptr\":1,"
	     "\"nbytes\":1}",
	     ECX_EPROTO},
	    {"{\"op\":\"pull\",\"mm_hash\":\"a/b\",\"dst_session\":\"a\","
	     "\"dst_ptr\":1,\"nbytes\":1}",
	     ECX_EID},
	    {"{\"op\":\"pull\",\"mm_hash\":\"a\",\"dst_session\":\"a\","
	     "\"dst_ptr\":-1,\"nbytes\":1}",
	     ECX_EPROTO},
	    {"{\"op\":\"pull\",\"mm_hash\":\"a\",\"dst_session\":\"a\","
	     "\"dst_ptr\":1,\"nbytes\":\"1\"}",
	     ECX_EPROTO},
	    {"{\"op\":\"pull\",\"mm_hash\":1}", ECX_EPROTO},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int rc = ecx_zreq_decode(bad[i].json, strlen(bad[i].json), &r,
		                         why, 160);
		if (rc != bad[i].err)
			fail_msg("zreq case %zu: got %s \"%s\"", i,
			         ecx_err_name(rc), why);
	}
	s = ecx_zresp_encode_error(ECX_ENOTFOUND, NULL);
	assert_string_equal(s, "{\"ok\":false,\"err\":\"unknown "
	                       "mm_hash\",\"code\":\"ENOTFOUND\"}");
	ecx_zresp z;
	assert_int_equal(ecx_zresp_decode(s, strlen(s), &z, why, 160), 0);
	assert_false(z.ok);
	assert_int_equal(z.err, ECX_ENOTFOUND);
	free(s);
	unsigned char key[ECX_LANE_KEY_LEN];
	for (size_t i = 0; i < sizeof(key); i++)
		key[i] = (unsigned char)(0xf1 - 7 * i);
	s = ecx_zresp_encode_hello(w, 10, 99, 5, 1764521000123ull, ECX_TR_TCP,
	                           15000, 4242, 987654, 40123, key);
	assert_int_equal(ecx_zresp_decode(s, strlen(s), &z, why, 160), 0);
	assert_true(z.ok);
	assert_int_equal(z.lane_port, 40123);
	assert_memory_equal(z.lane_key, key, sizeof(key));
	assert_int_equal(z.pid, 4242);
	assert_int_equal(z.pid_start, 987654);
	assert_int_equal(z.epoch, 99);
	assert_int_equal(z.conn, 5);
	assert_int_equal(z.now_ms, 1764521000123ull);
	assert_int_equal(z.transport, ECX_TR_TCP);
	assert_int_equal(z.idle_ms, 15000);
	ecx_zresp_free(&z);
	free(s);
	/* A producer from before now_ms: no clock, so pulls carry no
	 * expiry. */
	s = ecx_zresp_encode_hello(w, 10, 99, 5, 0, 0, 0, 0, 0, 0, NULL);
	assert_null(strstr(s, "now_ms"));
	assert_null(strstr(s, "transport"));
	assert_int_equal(ecx_zresp_decode(s, strlen(s), &z, why, 160), 0);
	assert_int_equal(z.now_ms, 0);
	assert_int_equal(z.transport, 0);
	assert_null(strstr(s, "idle_ms"));
	assert_int_equal(z.idle_ms, 0);
	assert_null(strstr(s, "lane"));
	assert_int_equal(z.lane_port, 0);
	assert_null(strstr(s, "pid"));
	assert_int_equal(z.pid, 0);
	assert_memory_equal(z.worker, w, 10);
	ecx_zresp_free(&z);
	free(s);
	/* The reference's replies. */
	const char *refok = "{\"ok\": true, \"mooncake_ret\": 0}";
	assert_int_equal(ecx_zresp_decode(refok, strlen(refok), &z, why, 160),
	                 0);
	assert_true(z.ok);
	const char *referr = "{\"ok\": false, \"err\": \"size mismatch\"}";
	assert_int_equal(ecx_zresp_decode(referr, strlen(referr), &z, why, 160),
	                 0);
	assert_false(z.ok);
	assert_string_equal(z.detail, "size mismatch");
	assert_int_equal(ecx_zresp_decode("{}", 2, &z, why, 160), ECX_EPROTO);
}

/* The hello's lane: what a consumer refuses to read as one. */
static void test_zresp_lane_rejects(void **state)
{
	(void)state;
	static const char *bad[] = {
	    "{\"ok\":true,\"worker\":\"AAAA\",\"epoch\":1,\"conn\":2,"
	    "\"lane\":{\"port\":0,\"key\":\"00112233445566778899aabbccddeeff\"}"
	    "}",
	    "{\"ok\":true,\"worker\":\"AAAA\",\"epoch\":1,\"conn\":2,"
	    "\"lane\":{\"port\":65536,\"key\":"
	    "\"00112233445566778899aabbccddeeff\"}}",
	    "{\"ok\":true,\"worker\":\"AAAA\",\"epoch\":1,\"conn\":2,"
	    "\"lane\":{\"port\":80.5,\"key\":"
	    "\"00112233445566778899aabbccddeeff\"}}",
	    "{\"ok\":true,\"worker\":\"AAAA\",\"epoch\":1,\"conn\":2,"
	    "\"lane\":{\"port\":80,\"key\":\"00112233\"}}",
	    "{\"ok\":true,\"worker\":\"AAAA\",\"epoch\":1,\"conn\":2,"
	    "\"lane\":{\"port\":80,\"key\":"
	    "\"zz112233445566778899aabbccddeeff\"}}",
	    "{\"ok\":true,\"worker\":\"AAAA\",\"epoch\":1,\"conn\":2,"
	    "\"lane\":80}",
	};
	char why[160];
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ecx_zresp z;
		assert_int_equal(ecx_zresp_decode(bad[i], strlen(bad[i]), &z,
		                                  why, sizeof(why)),
		                 ECX_EPROTO);
		assert_non_null(strstr(why, "lane"));
	}
	/* A pull asks for the lane only with its data as active messages. */
	ecx_pull_req r = {.req = 3, .data_am = true, .lane = true};
	char *s = ecx_pull_req_encode(&r);
	assert_non_null(strstr(s, "\"lane\":true"));
	ecx_pull_req d;
	assert_int_equal(
	    ecx_pull_req_decode(s, strlen(s), &d, why, sizeof(why)), 0);
	assert_true(d.lane);
	ecx_pull_req_free(&d);
	free(s);
	r.data_am = false;
	s = ecx_pull_req_encode(&r);
	assert_null(strstr(s, "lane"));
	free(s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_entry_roundtrip),
	    cmocka_unit_test(test_entry_reference),
	    cmocka_unit_test(test_entry_rejects),
	    cmocka_unit_test(test_lookup),
	    cmocka_unit_test(test_lookup_batch),
	    cmocka_unit_test(test_holders),
	    cmocka_unit_test(test_entry_bytes),
	    cmocka_unit_test(test_reader),
	    cmocka_unit_test(test_pull_bytes),
	    cmocka_unit_test(test_pull_roundtrip),
	    cmocka_unit_test(test_pull_rejects),
	    cmocka_unit_test(test_zmsg),
	    cmocka_unit_test(test_zresp_lane_rejects),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
