/* Tests of the HTTP registry: the real server on a free port on 127.0.0.1
 * and the real client (and plain libcurl for raw requests). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "registry/server.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static ecx_registry *start(const char *token, int token_reads)
{
	ecx_registry_params p = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                       ECX_REGISTRY_PARAM_PORT |
	                                       ECX_REGISTRY_PARAM_TOKEN |
	                                       ECX_REGISTRY_PARAM_TOKEN_READS,
	                         .bind_host = "127.0.0.1",
	                         .port = 0,
	                         .token = token,
	                         .token_reads = token_reads};
	ecx_registry *r = NULL;
	char why[200];
	int rc = ecx_registry_create(&p, &r, why, sizeof(why));
	if (rc != 0)
		fail_msg("registry: %s", why);
	assert_int_not_equal(ecx_registry_port(r), 0);
	return r;
}

static ecx_regclient *client(const char *urls, const char *token,
                             int timeout_ms)
{
	ecx_regclient_opts o = {.urls = urls,
	                        .token = token,
	                        .connect_timeout_ms = timeout_ms,
	                        .timeout_ms = timeout_ms};
	ecx_regclient *c = NULL;
	char why[200];
	if (ecx_regclient_create(&o, &c, why, sizeof(why)) != 0)
		fail_msg("client: %s", why);
	return c;
}

static void url_of(ecx_registry *r, char *out, size_t n)
{
	snprintf(out, n, "http://127.0.0.1:%u", ecx_registry_port(r));
}

static ecx_entry entry_for(uint64_t rows, const char *zmq)
{
	ecx_entry e;
	memset(&e, 0, sizeof(e));
	uint64_t shape[] = {rows, 3584};
	assert_int_equal(ecx_tensor_set(&e.desc, ECX_DTYPE_BFLOAT16, 2, shape),
	                 0);
	ecx_strlcpy(e.producer_zmq, zmq, sizeof(e.producer_zmq));
	return e;
}

/* A raw HTTP request with libcurl: status and body. */
static long raw(ecx_registry *r, const char *method, const char *path,
                const char *body, const char *auth, char *out, size_t outn)
{
	char url[512];
	snprintf(url, sizeof(url), "http://127.0.0.1:%u%s",
	         ecx_registry_port(r), path);
	CURL *h = curl_easy_init();
	FILE *f = fmemopen(out, outn, "w");
	struct curl_slist *hd = NULL;
	if (auth != NULL)
		hd = curl_slist_append(hd, auth);
	curl_easy_setopt(h, CURLOPT_URL, url);
	curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
	curl_easy_setopt(h, CURLOPT_WRITEDATA, f);
	curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
	curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 5000L);
	if (body != NULL)
		curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
	assert_int_equal(curl_easy_perform(h), CURLE_OK);
	long status = 0;
	curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
	fclose(f);
	out[outn - 1] = '\0';
	curl_slist_free_all(hd);
	curl_easy_cleanup(h);
	return status;
}

static void test_routes(void **state)
{
	(void)state;
	ecx_registry *r = start(NULL, 0);
	char url[64], why[200], body[8192];
	url_of(r, url, sizeof(url));
	ecx_regclient *c = client(url, NULL, 2000);

	ecx_entry e = entry_for(529, "tcp://127.0.0.1:7001");
	assert_int_equal(ecx_regclient_put(c, "img-a", &e, why, 200), 0);
	e = entry_for(1369, "tcp://127.0.0.1:7002");
	assert_int_equal(ecx_regclient_put(c, "img-b", &e, why, 200), 0);

	/* The reference's route. */
	assert_int_equal(
	    raw(r, "GET", "/ec/info/img-a", NULL, NULL, body, sizeof(body)),
	    200);
	assert_non_null(strstr(body, "\"nbytes\":3791872"));
	assert_non_null(
	    strstr(body, "\"producer_zmq\":\"tcp://127.0.0.1:7001\""));
	assert_int_equal(
	    raw(r, "GET", "/ec/info/nope", NULL, NULL, body, sizeof(body)),
	    404);
	assert_string_equal(body, "{\"detail\":\"unknown mm_hash\"}");
	assert_int_equal(
	    raw(r, "GET", "/ec/info/bad%7Cid", NULL, NULL, body, sizeof(body)),
	    400);
	assert_non_null(strstr(body, "\"detail\":\"id has byte '|'"));

	/* Single and batched lookups through the client. */
	ecx_lookup_item one = {.id = "img-b"};
	assert_int_equal(ecx_regclient_lookup(c, &one, 1, why, 200), 0);
	assert_true(one.found);
	assert_int_equal(one.entry.desc.shape[0], 1369);
	ecx_lookup_item many[3] = {
	    {.id = "img-a"}, {.id = "zz"}, {.id = "img-b"}};
	assert_int_equal(ecx_regclient_lookup(c, many, 3, why, 200), 0);
	assert_true(many[0].found && !many[1].found && many[2].found);
	assert_string_equal(many[2].entry.producer_zmq, "tcp://127.0.0.1:7002");

	/* Listing, in pages. */
	for (int i = 0; i < 5; i++) {
		char id[16];
		snprintf(id, sizeof(id), "p%d", i);
		assert_int_equal(ecx_regclient_put(c, id, &e, why, 200), 0);
	}
	assert_int_equal(
	    raw(r, "GET", "/ec/list?limit=3", NULL, NULL, body, sizeof(body)),
	    200);
	assert_non_null(strstr(body, "\"id\":\"img-a\""));
	assert_non_null(strstr(body, "\"next\":\"p0\""));
	assert_non_null(strstr(body, "\"total\":7"));
	assert_int_equal(raw(r, "GET", "/ec/list?after=p0&limit=10", NULL, NULL,
	                     body, sizeof(body)),
	                 200);
	assert_null(strstr(body, "\"id\":\"p0\""));
	assert_non_null(strstr(body, "\"id\":\"p4\""));
	assert_non_null(strstr(body, "\"next\":null"));
	assert_int_equal(raw(r, "GET", "/ec/list?limit=1001", NULL, NULL, body,
	                     sizeof(body)),
	                 400);
	assert_non_null(strstr(body, "at most 1000"));
	assert_int_equal(
	    raw(r, "GET", "/ec/list?limit=-1", NULL, NULL, body, sizeof(body)),
	    400);

	/* Removal: conditional on the producer, then plain. */
	assert_int_equal(
	    ecx_regclient_delete(c, "img-a", "tcp://other:1", why, 200),
	    ECX_ENOTFOUND);
	assert_int_equal(
	    ecx_regclient_delete(c, "img-a", "tcp://127.0.0.1:7001", why, 200),
	    0);
	assert_int_equal(ecx_regclient_delete(c, "img-a", NULL, why, 200),
	                 ECX_ENOTFOUND);
	one.id = "img-a";
	assert_int_equal(ecx_regclient_lookup(c, &one, 1, why, 200), 0);
	assert_false(one.found);

	/* Health, metrics, unknown routes and methods. */
	assert_int_equal(
	    raw(r, "GET", "/healthz", NULL, NULL, body, sizeof(body)), 200);
	assert_int_equal(
	    raw(r, "GET", "/metrics", NULL, NULL, body, sizeof(body)), 200);
	assert_non_null(strstr(body, "ecx_registry_publishes_total 7\n"));
	assert_non_null(strstr(body, "ecx_registry_removals_total 1\n"));
	assert_non_null(strstr(body, "ecx_registry_entries 6\n"));
	assert_non_null(strstr(body, "ecx_registry_lookups_total 7\n"));
	assert_non_null(strstr(body, "ecx_registry_hits_total 4\n"));
	assert_non_null(strstr(body, "ecx_registry_misses_total 3\n"));
	assert_non_null(strstr(
	    body, "ecx_registry_request_duration_seconds_bucket{le=\"+Inf\"}"));
	assert_int_equal(
	    raw(r, "GET", "/nothing", NULL, NULL, body, sizeof(body)), 404);
	assert_string_equal(body, "{\"detail\":\"Not Found\"}");
	assert_int_equal(
	    raw(r, "POST", "/ec/info/x", "{}", NULL, body, sizeof(body)), 405);
	assert_int_equal(
	    raw(r, "GET", "/ec/lookup", NULL, NULL, body, sizeof(body)), 405);

	/* Bad bodies. */
	assert_int_equal(raw(r, "PUT", "/ec/info/x", "{\"nbytes\":1}", NULL,
	                     body, sizeof(body)),
	                 400);
	assert_non_null(strstr(body, "missing field"));
	assert_int_equal(
	    raw(r, "PUT", "/ec/info/x", "nope", NULL, body, sizeof(body)), 400);
	assert_int_equal(raw(r, "POST", "/ec/lookup", "{\"ids\":[\"a b\"]}",
	                     NULL, body, sizeof(body)),
	                 400);
	assert_int_equal(raw(r, "POST", "/ec/lookup", "{\"ids\":7}", NULL, body,
	                     sizeof(body)),
	                 400);
	size_t big = ECX_REG_MAX_BODY + 100;
	char *huge = malloc(big + 1);
	memset(huge, ' ', big);
	huge[big] = '\0';
	assert_int_equal(
	    raw(r, "POST", "/ec/lookup", huge, NULL, body, sizeof(body)), 413);
	assert_non_null(strstr(body, "exceeds"));
	free(huge);
	/* Too many ids in one lookup. */
	char *ids = malloc(16 + 6 * (ECX_LOOKUP_MAX_IDS + 1));
	size_t off = (size_t)sprintf(ids, "{\"ids\":[");
	for (int i = 0; i <= ECX_LOOKUP_MAX_IDS; i++)
		off += (size_t)sprintf(ids + off, "%s\"a\"", i ? "," : "");
	strcpy(ids + off, "]}");
	assert_int_equal(
	    raw(r, "POST", "/ec/lookup", ids, NULL, body, sizeof(body)), 413);
	free(ids);

	/* The persistent connection carried all of the client's requests. */
	assert_int_equal(ecx_regclient_connects(c), 1);
	ecx_regclient_destroy(c);
	ecx_registry_destroy(r);
}

/* Entries live by a lease (the registry's, or their own); an id keeps
 * each producer's entry; POST /ec/renew renews one producer's entries. */
static void test_lease_and_holders(void **state)
{
	(void)state;
	ecx_registry_params p = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                       ECX_REGISTRY_PARAM_PORT |
	                                       ECX_REGISTRY_PARAM_ENTRY_TTL,
	                         .bind_host = "127.0.0.1",
	                         .port = 0,
	                         .entry_ttl_s = 1};
	ecx_registry *r = NULL;
	char why[200], url[64], body[8192];
	assert_int_equal(ecx_registry_create(&p, &r, why, sizeof(why)), 0);
	url_of(r, url, sizeof(url));
	ecx_regclient *c = client(url, NULL, 2000);
	/* The registry's lease: 1 s. */
	ecx_entry e = entry_for(4, "tcp://a:1");
	e.epoch = 5; /* an earlier start of a: not renewed below */
	assert_int_equal(ecx_regclient_put(c, "short", &e, why, 200), 0);
	e.epoch = 7;
	/* Its own lease: 3 s; two holders of one id. */
	e.ttl_s = 3;
	assert_int_equal(ecx_regclient_put(c, "both", &e, why, 200), 0);
	ecx_entry f = entry_for(4, "tcp://b:1");
	f.epoch = 8;
	f.ttl_s = 3;
	usleep(20000);
	assert_int_equal(ecx_regclient_put(c, "both", &f, why, 200), 0);
	assert_int_equal(
	    raw(r, "GET", "/ec/info/both", NULL, NULL, body, sizeof(body)),
	    200);
	assert_non_null(strstr(body, "tcp://b:1")); /* the newest */
	assert_non_null(strstr(body, "\"ecx_age_ms\":"));
	ecx_lookup_item it = {.id = "both"};
	assert_int_equal(ecx_regclient_lookup_holders(c, &it, 1, why, 200), 0);
	assert_true(it.found);
	assert_int_equal(it.nalt, 1);
	assert_string_equal(it.entry.producer_zmq, "tcp://b:1");
	assert_string_equal(it.alt[0].producer_zmq, "tcp://a:1");

	/* Renewals: by producer and epoch; bad bodies change nothing. */
	const char *ren = "{\"producer_zmq\":\"tcp://a:1\",\"ecx_epoch\":7,"
	                  "\"ecx_ttl_s\":3}";
	assert_int_equal(
	    raw(r, "POST", "/ec/renew", ren, NULL, body, sizeof(body)), 200);
	assert_string_equal(body, "{\"renewed\":1}");
	const char *other = "{\"producer_zmq\":\"tcp://a:1\",\"ecx_epoch\":9}";
	assert_int_equal(
	    raw(r, "POST", "/ec/renew", other, NULL, body, sizeof(body)), 200);
	assert_string_equal(body, "{\"renewed\":0}");
	assert_int_equal(raw(r, "POST", "/ec/renew", "{\"ecx_epoch\":7}", NULL,
	                     body, sizeof(body)),
	                 400);
	assert_int_equal(
	    raw(r, "GET", "/ec/renew", NULL, NULL, body, sizeof(body)), 405);

	/* After 1.5 s the registry's lease is over; the others live. */
	usleep(1500000);
	assert_int_equal(
	    raw(r, "GET", "/ec/info/short", NULL, NULL, body, sizeof(body)),
	    404);
	ecx_lookup_items_clear(&it, 1);
	it = (ecx_lookup_item){.id = "both"};
	assert_int_equal(ecx_regclient_lookup_holders(c, &it, 1, why, 200), 0);
	assert_int_equal(it.nalt, 1);
	/* Renewed at 0.02 s, a's at about 0.05 s: a is the newest now. */
	assert_string_equal(it.entry.producer_zmq, "tcp://a:1");
	/* b stops renewing: gone after its 3 s; a is renewed. */
	usleep(1000000);
	assert_int_equal(
	    raw(r, "POST", "/ec/renew", ren, NULL, body, sizeof(body)), 200);
	usleep(1000000);
	ecx_lookup_items_clear(&it, 1);
	it = (ecx_lookup_item){.id = "both"};
	assert_int_equal(ecx_regclient_lookup_holders(c, &it, 1, why, 200), 0);
	assert_true(it.found);
	assert_int_equal(it.nalt, 0);
	assert_string_equal(it.entry.producer_zmq, "tcp://a:1");
	assert_non_null(strstr(
	    (raw(r, "GET", "/ec/list", NULL, NULL, body, sizeof(body)), body),
	    "\"total\":1"));

	/* A producer's removal takes its own entry only. */
	assert_int_equal(ecx_regclient_put(c, "both", &f, why, 200), 0);
	assert_int_equal(ecx_regclient_delete(c, "both", "tcp://b:1", why, 200),
	                 0);
	ecx_lookup_items_clear(&it, 1);
	it = (ecx_lookup_item){.id = "both"};
	assert_int_equal(ecx_regclient_lookup_holders(c, &it, 1, why, 200), 0);
	assert_true(it.found);
	assert_string_equal(it.entry.producer_zmq, "tcp://a:1");
	assert_int_equal(ecx_regclient_delete(c, "both", NULL, why, 200), 0);
	ecx_lookup_items_clear(&it, 1);
	it = (ecx_lookup_item){.id = "both"};
	assert_int_equal(ecx_regclient_lookup_holders(c, &it, 1, why, 200), 0);
	assert_false(it.found);
	ecx_lookup_items_clear(&it, 1);
	ecx_regclient_destroy(c);
	ecx_registry_destroy(r);
}

static void test_token(void **state)
{
	(void)state;
	ecx_registry *r = start("s3cret", 0);
	char url[64], why[200], body[4096];
	url_of(r, url, sizeof(url));
	ecx_regclient *anon = client(url, NULL, 2000);
	ecx_regclient *wrong = client(url, "s3cres", 2000);
	ecx_regclient *good = client(url, "s3cret", 2000);
	ecx_entry e = entry_for(4, "tcp://h:1");
	assert_int_equal(ecx_regclient_put(anon, "a", &e, why, 200), ECX_EAUTH);
	assert_int_equal(ecx_regclient_put(wrong, "a", &e, why, 200),
	                 ECX_EAUTH);
	assert_null(strstr(why, "s3cre")); /* the token is not echoed */
	assert_int_equal(raw(r, "PUT", "/ec/info/a", "{}",
	                     "Authorization: s3cret", body, sizeof(body)),
	                 401);
	ecx_lookup_item it = {.id = "a"};
	assert_int_equal(ecx_regclient_lookup(anon, &it, 1, why, 200), 0);
	assert_false(it.found); /* nothing was written */
	assert_int_equal(ecx_regclient_put(good, "a", &e, why, 200), 0);
	/* Reads stay open. */
	assert_int_equal(ecx_regclient_lookup(anon, &it, 1, why, 200), 0);
	assert_true(it.found);
	assert_int_equal(ecx_regclient_delete(anon, "a", NULL, why, 200),
	                 ECX_EAUTH);
	assert_int_equal(ecx_regclient_delete(good, "a", NULL, why, 200), 0);
	ecx_regclient_destroy(anon);
	ecx_regclient_destroy(wrong);
	ecx_regclient_destroy(good);
	ecx_registry_destroy(r);

	/* With --token-reads, reads need it too (but /healthz does not). */
	r = start("s3cret", 1);
	url_of(r, url, sizeof(url));
	anon = client(url, NULL, 2000);
	good = client(url, "s3cret", 2000);
	assert_int_equal(ecx_regclient_put(good, "a", &e, why, 200), 0);
	assert_int_equal(ecx_regclient_lookup(anon, &it, 1, why, 200),
	                 ECX_EAUTH);
	assert_false(it.found);
	assert_int_equal(ecx_regclient_lookup(good, &it, 1, why, 200), 0);
	assert_true(it.found);
	assert_int_equal(raw(r, "GET", "/ec/info/a", NULL,
	                     "Authorization: Bearer s3cret", body,
	                     sizeof(body)),
	                 200);
	assert_int_equal(
	    raw(r, "GET", "/metrics", NULL, NULL, body, sizeof(body)), 401);
	assert_int_equal(
	    raw(r, "GET", "/healthz", NULL, NULL, body, sizeof(body)), 200);
	ecx_regclient_destroy(anon);
	ecx_regclient_destroy(good);
	ecx_registry_destroy(r);
}

/* Concurrent writers and readers: every entry read is whole (its shape,
 * nbytes and producer agree), and every write lands. */
#define WRITERS 3
#define READERS 3
#define PER 200

typedef struct conc_arg {
	char url[64];
	int idx;
	int bad;
} conc_arg;

static void *writer(void *p)
{
	conc_arg *a = p;
	ecx_regclient *c = client(a->url, NULL, 5000);
	char why[200];
	for (int i = 0; i < PER; i++) {
		char id[32], zmq[64];
		snprintf(id, sizeof(id), "w%d-%d", a->idx, i);
		snprintf(zmq, sizeof(zmq), "tcp://h:%d", 1 + i);
		ecx_entry e = entry_for((uint64_t)(1 + i), zmq);
		if (ecx_regclient_put(c, id, &e, why, 200) != 0)
			a->bad++;
	}
	ecx_regclient_destroy(c);
	return NULL;
}

static void *reader(void *p)
{
	conc_arg *a = p;
	ecx_regclient *c = client(a->url, NULL, 5000);
	char why[200];
	for (int round = 0; round < PER / 4; round++) {
		char ids[16][32];
		ecx_lookup_item it[16];
		for (int k = 0; k < 16; k++) {
			snprintf(ids[k], sizeof(ids[k]), "w%d-%d", k % WRITERS,
			         (round * 4 + k) % PER);
			it[k].id = ids[k];
		}
		if (ecx_regclient_lookup(c, it, 16, why, 200) != 0)
			a->bad++;
		for (int k = 0; k < 16; k++) {
			if (!it[k].found)
				continue;
			int i = (round * 4 + k) % PER;
			char zmq[64];
			snprintf(zmq, sizeof(zmq), "tcp://h:%d", 1 + i);
			if (it[k].entry.desc.shape[0] != (uint64_t)(1 + i) ||
			    strcmp(it[k].entry.producer_zmq, zmq) != 0)
				a->bad++;
		}
	}
	ecx_regclient_destroy(c);
	return NULL;
}

static void test_concurrent(void **state)
{
	(void)state;
	ecx_registry *r = start(NULL, 0);
	pthread_t t[WRITERS + READERS];
	conc_arg a[WRITERS + READERS];
	for (int i = 0; i < WRITERS + READERS; i++) {
		url_of(r, a[i].url, sizeof(a[i].url));
		a[i].idx = i;
		a[i].bad = 0;
		pthread_create(&t[i], NULL, i < WRITERS ? writer : reader,
		               &a[i]);
	}
	for (int i = 0; i < WRITERS + READERS; i++) {
		pthread_join(t[i], NULL);
		assert_int_equal(a[i].bad, 0);
	}
	ecx_store *s = ecx_registry_store(r);
	assert_int_equal(s->ops->count(s), WRITERS * PER);
	ecx_registry_destroy(r);
}

/* A registry that is down costs at most its timeout, then is skipped. */
static void test_down(void **state)
{
	(void)state;
	/* A port with nothing listening: refused at once. */
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET,
	                         .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	socklen_t sl = sizeof(sa);
	getsockname(fd, (struct sockaddr *)&sa, &sl);
	char url[64], why[200];
	snprintf(url, sizeof(url), "http://127.0.0.1:%u", ntohs(sa.sin_port));
	ecx_regclient *c = client(url, NULL, 300);
	ecx_lookup_item it = {.id = "a"};
	uint64_t t0 = ecx_now_ms();
	assert_int_equal(ecx_regclient_lookup(c, &it, 1, why, 200),
	                 ECX_ECONNECT);
	assert_true(ecx_now_ms() - t0 < 1000);
	assert_non_null(strstr(why, url));
	ecx_regclient_destroy(c);

	/* A port that accepts but never answers: times out within bound. */
	assert_int_equal(listen(fd, 8), 0);
	c = client(url, NULL, 300);
	t0 = ecx_now_ms();
	assert_int_equal(ecx_regclient_lookup(c, &it, 1, why, 200),
	                 ECX_ETIMEDOUT);
	uint64_t took = ecx_now_ms() - t0;
	assert_true(took >= 250 && took < 1500);
	/* Within the back-off the dead registry costs nothing. */
	t0 = ecx_now_ms();
	assert_int_equal(ecx_regclient_lookup(c, &it, 1, why, 200),
	                 ECX_ECONNECT);
	assert_true(ecx_now_ms() - t0 < 50);
	assert_non_null(strstr(why, "retrying later"));

	/* With a live registry behind it, ids are still found. */
	ecx_registry *r = start(NULL, 0);
	char both[160], live[64];
	url_of(r, live, sizeof(live));
	snprintf(both, sizeof(both), "%s, %s", url, live);
	ecx_regclient *w = client(live, NULL, 1000);
	ecx_entry e = entry_for(2, "tcp://h:2");
	assert_int_equal(ecx_regclient_put(w, "a", &e, why, 200), 0);
	ecx_regclient *cb = client(both, NULL, 300);
	assert_int_equal(ecx_regclient_lookup(cb, &it, 1, why, 200), 0);
	assert_true(it.found);
	ecx_regclient_destroy(cb);
	ecx_regclient_destroy(w);
	ecx_regclient_destroy(c);
	ecx_registry_destroy(r);
	close(fd);
}

/* A server that answers garbage gives a clear error. */
static void *garbage_server(void *p)
{
	int lfd = *(int *)p;
	const char *answers[] = {
	    "HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\ngarbage",
	    "HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"found\":1}",
	    "SSH-2.0-OpenSSH_9.2\r\n\r\n"};
	for (int i = 0; i < 3; i++) {
		int c = accept(lfd, NULL, NULL);
		if (c < 0)
			return NULL;
		char req[4096];
		ssize_t n = recv(c, req, sizeof(req), 0);
		(void)n;
		ssize_t w = send(c, answers[i], strlen(answers[i]), 0);
		(void)w;
		close(c);
	}
	return NULL;
}

static void test_garbage(void **state)
{
	(void)state;
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET,
	                         .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	bind(fd, (struct sockaddr *)&sa, sizeof(sa));
	socklen_t sl = sizeof(sa);
	getsockname(fd, (struct sockaddr *)&sa, &sl);
	listen(fd, 8);
	pthread_t t;
	pthread_create(&t, NULL, garbage_server, &fd);
	char url[64], why[200];
	snprintf(url, sizeof(url), "http://127.0.0.1:%u", ntohs(sa.sin_port));
	ecx_lookup_item it = {.id = "a"};
	ecx_regclient *c = client(url, NULL, 1000);
	assert_int_equal(ecx_regclient_lookup(c, &it, 1, why, 200), ECX_EPROTO);
	assert_non_null(strstr(why, "cannot read"));
	ecx_regclient_destroy(c);
	ecx_lookup_item two[2] = {{.id = "a"}, {.id = "b"}};
	c = client(url, NULL, 1000);
	assert_int_equal(ecx_regclient_lookup(c, two, 2, why, 200), ECX_EPROTO);
	ecx_regclient_destroy(c);
	c = client(url, NULL, 1000);
	int rc = ecx_regclient_lookup(c, &it, 1, why, 200);
	assert_true(rc == ECX_EPROTO || rc == ECX_EIO);
	ecx_regclient_destroy(c);
	pthread_join(t, NULL);
	close(fd);
}

static void test_start_errors(void **state)
{
	(void)state;
	ecx_registry *r = start(NULL, 0), *r2 = NULL;
	char why[200];
	ecx_registry_params p = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                       ECX_REGISTRY_PARAM_PORT,
	                         .bind_host = "127.0.0.1",
	                         .port = ecx_registry_port(r)};
	assert_int_equal(ecx_registry_create(&p, &r2, why, 200),
	                 ECX_EADDRINUSE);
	assert_non_null(strstr(why, "already in use"));
	p.bind_host = "no.such.host.invalid";
	p.port = 0;
	assert_int_equal(ecx_registry_create(&p, &r2, why, 200), ECX_EINVAL);
	assert_non_null(strstr(why, "no.such.host.invalid"));
	p.bind_host = "10.255.255.254"; /* not an address of this machine */
	assert_int_equal(ecx_registry_create(&p, &r2, why, 200), ECX_EINVAL);
	assert_null(r2);
	ecx_registry_destroy(r);
	ecx_regclient *c;
	ecx_regclient_opts o = {.urls = "ftp://x"};
	assert_int_equal(ecx_regclient_create(&o, &c, why, 200), ECX_EINVAL);
	o.urls = " , ";
	assert_int_equal(ecx_regclient_create(&o, &c, why, 200), ECX_EINVAL);
}

int main(void)
{
	curl_global_init(CURL_GLOBAL_DEFAULT);
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_routes),
	    cmocka_unit_test(test_lease_and_holders),
	    cmocka_unit_test(test_token),
	    cmocka_unit_test(test_concurrent),
	    cmocka_unit_test(test_down),
	    cmocka_unit_test(test_garbage),
	    cmocka_unit_test(test_start_errors),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	curl_global_cleanup();
	return rc;
}
