/*
 * regclient.h - the registry client's own state and request plumbing,
 * shared by client.c (connections, lookups, listings, health) and
 * client_write.c (publishing, removals, renewals). Private to dir/.
 */
#ifndef ECX_DIR_REGCLIENT_H
#define ECX_DIR_REGCLIENT_H

#include "dir/dir.h"

#include <curl/curl.h>

#define MAX_REGISTRIES 16

typedef struct buf {
	char *p;
	size_t len, cap;
} buf;

typedef struct reg_conn {
	char url[ECX_ADDR_MAX]; /* without a trailing slash */
	CURL *curl;
	CURLM *multi; /* runs curl's transfers, so that they can poll first */
	ecx_store *redis; /* a redis:// registry: its store, used directly */
	bool sentinel;    /* redis+sentinel:// */
	uint64_t down_until_ms; /* skip until then; 0 when up */
	uint64_t backoff_ms;
	uint64_t failed_ms; /* when it last failed */
	bool no_batch;      /* it has no POST /ec/lookup: lookups GET each id */
	/* The answers of lookups, kept between them (len reset each time):
	 * a batch's answer need not grow a new buffer every time. */
	buf rx;
} reg_conn;

struct ecx_regclient {
	reg_conn regs[MAX_REGISTRIES];
	uint64_t seen_epoch; /* of the first registry, by ecx_regclient_sync */
	bool was_down;
	size_t nregs;
	struct curl_slist *headers; /* Content-Type and Authorization */
	int connect_timeout_ms, timeout_ms;
	int spin_us; /* polls an answer this long before sleeping; 0: never */
	int ttl_s;   /* the lease asked for this client's entries */
	/* A registry whose store renews by writes (Redis behind HTTP): the
	 * entries are written again every third of the lease, no oftener. */
	bool renew_by_writes;
	uint64_t written_ms;
	long connects;
};

/* Sends one request on registry g (its persistent connection), body may
 * be NULL; the answer's status in *status and body in *resp. */
int regc_request(ecx_regclient *c, reg_conn *g, const char *method,
                 const char *path, const char *body, long *status, buf *resp,
                 char *why, size_t whylen);
/* Whether g is worth asking now (not backing off), and its back-off
 * after a request that ended with rc. */
bool regc_usable(reg_conn *g, uint64_t now);
void regc_mark(reg_conn *g, int rc);
/* When every registry of c is backing off: the index of the one to ask
 * anyway (the soonest due, at most once a second), so that a directory
 * that comes back is seen within a second, not at the end of a back-off
 * of up to 10 s; SIZE_MAX when one is usable or none is due. */
size_t regc_probe(const ecx_regclient *c, uint64_t now);
/* The detail of the registries' 404 for an id they do not hold. */
#define ECX_MISS_DETAIL "unknown mm_hash"
/* Whether b is the registries' answer for an id they do not hold,
 * {"detail": "unknown mm_hash"} (the reference's and ecx's). */
bool regc_is_miss(const buf *b);
/* The error of an HTTP answer that is not a success: a 404 other than a
 * miss is ECX_EINVAL, a URL that names no registry. */
int regc_http_err(long status, const buf *b, const char *url, char *why,
                  size_t whylen);

#endif /* ECX_DIR_REGCLIENT_H */
