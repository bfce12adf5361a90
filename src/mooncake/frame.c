/* frame.c - Mooncake's TCP wire codec (see frame.h). */
#include "mooncake/frame.h"

#include "wire/wire.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void put_le64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le64(const uint8_t *p)
{
	uint64_t v = 0;
	for (int i = 7; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

/* ---- handshake frames ---- */

void ecx_mc_hs_prefix_encode(uint8_t out[ECX_MC_HS_PREFIX], uint8_t type,
                             size_t json_len)
{
	put_le64(out, (uint64_t)json_len + 1);
	out[8] = type;
}

uint8_t *ecx_mc_hs_frame_encode(uint8_t type, const char *json, size_t json_len,
                                size_t *out_len)
{
	if (json_len >= ECX_MC_HS_MAX)
		return NULL;
	uint8_t *f = malloc(ECX_MC_HS_PREFIX + json_len);
	if (f == NULL)
		return NULL;
	ecx_mc_hs_prefix_encode(f, type, json_len);
	if (json_len > 0)
		memcpy(f + ECX_MC_HS_PREFIX, json, json_len);
	*out_len = ECX_MC_HS_PREFIX + json_len;
	return f;
}

int ecx_mc_hs_len_decode(const uint8_t in[ECX_MC_HS_LEN_BYTES],
                         uint64_t *body_len, char *why, size_t whylen)
{
	uint64_t n = get_le64(in);
	if (n == 0)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "handshake frame of length 0");
	if (n > ECX_MC_HS_MAX)
		return ecx_why(
		    why, whylen, ECX_ETOOBIG,
		    "handshake frame of %llu bytes exceeds the limit "
		    "of %u",
		    (unsigned long long)n, ECX_MC_HS_MAX);
	*body_len = n;
	return 0;
}

int ecx_mc_hs_body_decode(const uint8_t *body, size_t len, uint8_t *type,
                          const char **json, size_t *json_len, char *why,
                          size_t whylen)
{
	if (body == NULL || len == 0)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "empty handshake frame");
	if (len > ECX_MC_HS_MAX)
		return ecx_why(why, whylen, ECX_ETOOBIG,
		               "handshake frame of %zu bytes exceeds the limit "
		               "of %u",
		               len, ECX_MC_HS_MAX);
	uint8_t b = body[0];
	if (b <= ECX_MC_HS_PROBE) {
		*type = b;
		*json = (const char *)body + 1;
		*json_len = len - 1;
		return 0;
	}
	if (b < 0x80) {
		*type = ECX_MC_HS_UNTYPED;
		*json = (const char *)body;
		*json_len = len;
		return 0;
	}
	return ecx_why(why, whylen, ECX_EPROTO,
	               "unknown handshake frame type 0x%02x", b);
}

/* ---- segment descriptor ---- */

static void local_timestamp(char *out, size_t cap)
{
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	time_t t = ts.tv_sec;
	if (localtime_r(&t, &tm) == NULL) {
		out[0] = '\0';
		return;
	}
	char day[24];
	if (strftime(day, sizeof(day), "%Y-%m-%d %H:%M:%S", &tm) == 0) {
		out[0] = '\0';
		return;
	}
	unsigned us = (unsigned)(ts.tv_nsec / 1000) % 1000000u;
	snprintf(out, cap, "%.19s.%06u", day, us);
}

char *ecx_mc_segment_encode(const ecx_mc_segment *s, size_t *out_len)
{
	/* jsoncpp keeps an object's members sorted by key; cJSON prints
	 * them in the order they are added, so they are added sorted. */
	cJSON *o = cJSON_CreateObject();
	cJSON *bufs = cJSON_CreateArray();
	if (o == NULL || bufs == NULL) {
		cJSON_Delete(o);
		cJSON_Delete(bufs);
		return NULL;
	}
	cJSON_AddItemToObject(o, "buffers", bufs);
	bool ok = true;
	for (size_t i = 0; ok && i < s->n_buffers; i++) {
		const ecx_mc_buffer *b = &s->buffers[i];
		cJSON *e = cJSON_CreateObject();
		cJSON *a = ecx_json_u64(b->addr);
		cJSON *l = ecx_json_u64(b->length);
		cJSON *n = cJSON_CreateString(b->name ? b->name : "");
		ok = e != NULL && a != NULL && l != NULL && n != NULL;
		if (!ok) {
			cJSON_Delete(e);
			cJSON_Delete(a);
			cJSON_Delete(l);
			cJSON_Delete(n);
			break;
		}
		cJSON_AddItemToObject(e, "addr", a);
		cJSON_AddItemToObject(e, "length", l);
		cJSON_AddItemToObject(e, "name", n);
		cJSON_AddItemToArray(bufs, e);
	}
	char ts[ECX_MC_TIME_MAX];
	if (s->timestamp[0] != '\0')
		ecx_strlcpy(ts, s->timestamp, sizeof(ts));
	else
		local_timestamp(ts, sizeof(ts));
	ok = ok && cJSON_AddStringToObject(o, "name", s->name) != NULL &&
	     cJSON_AddStringToObject(o, "protocol", "tcp") != NULL &&
	     cJSON_AddNumberToObject(o, "tcp_data_port", s->tcp_data_port) !=
	         NULL &&
	     cJSON_AddNumberToObject(o, "tcp_proto_version",
	                             s->tcp_proto_version) != NULL &&
	     cJSON_AddStringToObject(o, "timestamp", ts) != NULL;
	char *txt = ok ? cJSON_PrintUnformatted(o) : NULL;
	cJSON_Delete(o);
	if (txt == NULL)
		return NULL;
	/* jsoncpp's FastWriter ends the document with a newline. */
	size_t n = strlen(txt);
	char *out = realloc(txt, n + 2);
	if (out == NULL) {
		free(txt);
		return NULL;
	}
	out[n] = '\n';
	out[n + 1] = '\0';
	if (out_len != NULL)
		*out_len = n + 1;
	return out;
}

void ecx_mc_segment_free(ecx_mc_segment *s)
{
	if (s == NULL)
		return;
	free(s->buffers);
	memset(s, 0, sizeof(*s));
}

/* A small non-negative integer field (a port, a version). */
static int get_small(const cJSON *o, const char *key, uint64_t max,
                     uint64_t *out, char *why, size_t whylen)
{
	int rc = ecx_json_get_u64(o, key, out, why, whylen);
	if (rc != 0)
		return rc;
	if (*out > max)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is out of range (at most %llu)", key,
		               (unsigned long long)max);
	return 0;
}

static int decode_buffers(const cJSON *arr, ecx_mc_segment *out, char *why,
                          size_t whylen)
{
	if (arr == NULL || cJSON_IsNull(arr))
		return 0;
	if (!cJSON_IsArray(arr))
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"buffers\" is not an array");
	size_t n = 0, names = 0;
	const cJSON *e;
	cJSON_ArrayForEach (e, arr) {
		if (!cJSON_IsObject(e))
			return ecx_why(why, whylen, ECX_EPROTO,
			               "buffer %zu is not an object", n);
		const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name");
		if (!cJSON_IsString(nm) || nm->valuestring == NULL ||
		    nm->valuestring[0] == '\0')
			return ecx_why(why, whylen, ECX_EPROTO,
			               "buffer %zu has no name", n);
		names += strlen(nm->valuestring) + 1;
		n++;
	}
	if (n == 0)
		return 0;
	/* One block: the array, then the names it points to. */
	ecx_mc_buffer *b = malloc(n * sizeof(*b) + names);
	if (b == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM,
		               "out of memory for %zu buffers", n);
	char *np = (char *)(b + n);
	size_t i = 0;
	cJSON_ArrayForEach (e, arr) {
		char w[96];
		int rc;
		if ((rc = ecx_json_get_u64(e, "addr", &b[i].addr, w,
		                           sizeof(w))) != 0 ||
		    (rc = ecx_json_get_u64(e, "length", &b[i].length, w,
		                           sizeof(w))) != 0) {
			free(b);
			return ecx_why(why, whylen, rc, "buffer %zu: %s", i, w);
		}
		if (b[i].addr == 0 || b[i].length == 0) {
			free(b);
			return ecx_why(why, whylen, ECX_EPROTO,
			               "buffer %zu has a zero %s", i,
			               b[i].addr == 0 ? "addr" : "length");
		}
		if (b[i].addr + b[i].length < b[i].addr) {
			free(b);
			return ecx_why(why, whylen, ECX_EPROTO,
			               "buffer %zu wraps past 2^64", i);
		}
		const char *nm =
		    cJSON_GetObjectItemCaseSensitive(e, "name")->valuestring;
		size_t k = strlen(nm) + 1;
		memcpy(np, nm, k);
		b[i].name = np;
		np += k;
		i++;
	}
	out->buffers = b;
	out->n_buffers = n;
	return 0;
}

int ecx_mc_segment_decode(const char *json, size_t len, ecx_mc_segment *out,
                          char *why, size_t whylen)
{
	ecx_mc_segment s;
	memset(&s, 0, sizeof(s));
	cJSON *o = ecx_json_parse(json, len, ECX_MC_HS_MAX, why, whylen);
	if (o == NULL)
		return len > ECX_MC_HS_MAX ? ECX_ETOOBIG : ECX_EPROTO;
	int rc;
	const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "protocol");
	if (p == NULL) {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "missing field \"protocol\"");
		goto out;
	}
	if (!cJSON_IsString(p) || strcmp(p->valuestring, "tcp") != 0) {
		rc = ecx_why(why, whylen, ECX_EUNSUPPORTED,
		             "segment protocol is not \"tcp\"");
		goto out;
	}
	if ((rc = ecx_json_get_str(o, "name", s.name, sizeof(s.name), why,
	                           whylen)) != 0)
		goto out;
	char host[ECX_MC_NAME_MAX], w[160];
	uint16_t port;
	if (ecx_mc_host_port(s.name, host, sizeof(host), &port, w, sizeof(w)) !=
	    0) {
		rc = ecx_why(why, whylen, ECX_EPROTO, "segment name: %s", w);
		goto out;
	}
	uint64_t v;
	if ((rc = get_small(o, "tcp_data_port", 65535, &v, why, whylen)) != 0)
		goto out;
	if (v == 0) {
		rc = ecx_why(why, whylen, ECX_EPROTO, "\"tcp_data_port\" is 0");
		goto out;
	}
	s.tcp_data_port = (uint16_t)v;
	s.tcp_proto_version = 1;
	if (cJSON_GetObjectItemCaseSensitive(o, "tcp_proto_version") != NULL) {
		if ((rc = get_small(o, "tcp_proto_version", 255, &v, why,
		                    whylen)) != 0)
			goto out;
		s.tcp_proto_version = (uint8_t)v;
	}
	const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "timestamp");
	if (t != NULL) {
		if (!cJSON_IsString(t) || t->valuestring == NULL) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "\"timestamp\" is not a string");
			goto out;
		}
		ecx_strlcpy(s.timestamp, t->valuestring, sizeof(s.timestamp));
	}
	rc = decode_buffers(cJSON_GetObjectItemCaseSensitive(o, "buffers"), &s,
	                    why, whylen);
out:
	cJSON_Delete(o);
	if (rc != 0) {
		ecx_mc_segment_free(&s);
		return rc;
	}
	*out = s;
	return 0;
}

bool ecx_mc_range_within(uint64_t addr, uint64_t size, uint64_t base,
                         uint64_t length)
{
	if (size == 0 || addr + size < addr || base + length < base)
		return false;
	return base <= addr && addr + size <= base + length;
}

long ecx_mc_segment_find(const ecx_mc_segment *s, uint64_t addr, uint64_t size)
{
	for (size_t i = 0; i < s->n_buffers; i++)
		if (ecx_mc_range_within(addr, size, s->buffers[i].addr,
		                        s->buffers[i].length))
			return (long)i;
	return -1;
}

int ecx_mc_host_port(const char *name, char *host, size_t cap, uint16_t *port,
                     char *why, size_t whylen)
{
	if (name == NULL || name[0] == '\0')
		return ecx_why(why, whylen, ECX_EINVAL, "empty session name");
	const char *h = name, *hend, *colon;
	if (name[0] == '[') {
		const char *rb = strchr(name, ']');
		if (rb == NULL || rb[1] != ':')
			return ecx_why(why, whylen, ECX_EINVAL,
			               "session \"%.64s\" is not [v6]:port",
			               name);
		h = name + 1;
		hend = rb;
		colon = rb + 1;
	} else {
		colon = strrchr(name, ':');
		if (colon == NULL)
			return ecx_why(why, whylen, ECX_EINVAL,
			               "session \"%.64s\" has no port", name);
		hend = colon;
		if (memchr(name, ':', (size_t)(colon - name)) != NULL)
			return ecx_why(why, whylen, ECX_EINVAL,
			               "session \"%.64s\": an IPv6 host "
			               "needs brackets",
			               name);
	}
	size_t hl = (size_t)(hend - h);
	if (hl == 0)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "session \"%.64s\" has no host", name);
	if (hl >= cap)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "session host longer than %zu bytes", cap - 1);
	const char *ps = colon + 1;
	unsigned long p = 0;
	size_t nd = 0;
	for (; ps[nd] != '\0'; nd++) {
		if (ps[nd] < '0' || ps[nd] > '9' || nd >= 5)
			return ecx_why(why, whylen, ECX_EINVAL,
			               "session \"%.64s\": bad port", name);
		p = p * 10 + (unsigned long)(ps[nd] - '0');
	}
	if (nd == 0 || p == 0 || p > 65535)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "session \"%.64s\": bad port", name);
	memcpy(host, h, hl);
	host[hl] = '\0';
	*port = (uint16_t)p;
	return 0;
}

/* ---- data port ---- */

void ecx_mc_hdr_encode(const ecx_mc_hdr *h, uint8_t out[ECX_MC_HDR_LEN])
{
	memset(out, 0, ECX_MC_HDR_LEN);
	put_le64(out, h->size);
	put_le64(out + 8, h->addr);
	out[16] = h->opcode;
}

void ecx_mc_hdr_decode(const uint8_t in[ECX_MC_HDR_LEN], ecx_mc_hdr *h)
{
	h->size = get_le64(in);
	h->addr = get_le64(in + 8);
	h->opcode = in[16];
}

void ecx_mc_status_encode(uint64_t status, uint8_t out[ECX_MC_STATUS_LEN])
{
	put_le64(out, status);
}

uint64_t ecx_mc_status_decode(const uint8_t in[ECX_MC_STATUS_LEN])
{
	return get_le64(in);
}
