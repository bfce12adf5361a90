/* Unit tests for src/mooncake/frame.c: byte-level fixtures of Mooncake's
 * TCP wire, each naming the Mooncake source (kvcache-ai/Mooncake,
 * mooncake-transfer-engine/) whose bytes it follows, and each refusal. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "mooncake/frame.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* include/common.h writeString(): u64 length (native, here little-endian)
 * counting the type byte, the type, then jsoncpp FastWriter's JSON, which
 * ends with '\n'. A probe (transfer_metadata_plugin.cpp doSendProbe) sends
 * an empty object. */
static void test_hs_probe_bytes(void **state)
{
	(void)state;
	static const uint8_t want[] = {0x04, 0, 0,    0,   0,   0,
	                               0,    0, 0x03, '{', '}', '\n'};
	size_t n = 0;
	uint8_t *f = ecx_mc_hs_frame_encode(ECX_MC_HS_PROBE, "{}\n", 3, &n);
	assert_non_null(f);
	assert_int_equal(n, sizeof(want));
	assert_memory_equal(f, want, sizeof(want));

	uint64_t len = 0;
	char why[160];
	assert_int_equal(ecx_mc_hs_len_decode(f, &len, why, sizeof(why)), 0);
	assert_int_equal(len, 4);
	uint8_t type = 0xee;
	const char *json = NULL;
	size_t jl = 0;
	assert_int_equal(ecx_mc_hs_body_decode(f + 8, (size_t)len, &type, &json,
	                                       &jl, why, sizeof(why)),
	                 0);
	assert_int_equal(type, ECX_MC_HS_PROBE);
	assert_int_equal(jl, 3);
	assert_memory_equal(json, "{}\n", 3);
	free(f);

	uint8_t pre[ECX_MC_HS_PREFIX];
	ecx_mc_hs_prefix_encode(pre, ECX_MC_HS_METADATA, 0x1234);
	static const uint8_t wantp[] = {0x35, 0x12, 0, 0, 0, 0, 0, 0, 0x01};
	assert_memory_equal(pre, wantp, sizeof(wantp));
}

/* include/common.h readString(): a length of 0 or over 1 MiB
 * (kDefaultHandshakeMaxLength) is refused before anything else is read;
 * a first body byte at most Probe (compared as a signed char) is the type,
 * any other is the untyped old protocol, the whole body being JSON. */
static void test_hs_refusals(void **state)
{
	(void)state;
	char why[160];
	uint64_t len = 99;
	static const uint8_t zero[8] = {0};
	assert_int_equal(ecx_mc_hs_len_decode(zero, &len, why, sizeof(why)),
	                 ECX_EPROTO);
	assert_int_equal(len, 99);
	static const uint8_t cap[8] = {0x00, 0x00, 0x10, 0, 0, 0, 0, 0};
	assert_int_equal(ecx_mc_hs_len_decode(cap, &len, why, sizeof(why)), 0);
	assert_int_equal(len, 1u << 20);
	static const uint8_t over[8] = {0x01, 0x00, 0x10, 0, 0, 0, 0, 0};
	assert_int_equal(ecx_mc_hs_len_decode(over, &len, why, sizeof(why)),
	                 ECX_ETOOBIG);
	static const uint8_t huge[8] = {0, 0, 0, 0, 0, 0, 0, 0x80};
	assert_int_equal(ecx_mc_hs_len_decode(huge, &len, why, sizeof(why)),
	                 ECX_ETOOBIG);
	assert_non_null(strstr(why, "exceeds"));

	uint8_t type;
	const char *json;
	size_t jl;
	const uint8_t old[] = "{\"a\":1}";
	assert_int_equal(
	    ecx_mc_hs_body_decode(old, 7, &type, &json, &jl, why, sizeof(why)),
	    0);
	assert_int_equal(type, ECX_MC_HS_UNTYPED);
	assert_int_equal(jl, 7);
	assert_ptr_equal(json, (const char *)old);
	const uint8_t neg[] = {0x80, '{', '}'};
	assert_int_equal(
	    ecx_mc_hs_body_decode(neg, 3, &type, &json, &jl, why, sizeof(why)),
	    ECX_EPROTO);
	const uint8_t conn[] = {0x00};
	assert_int_equal(
	    ecx_mc_hs_body_decode(conn, 1, &type, &json, &jl, why, sizeof(why)),
	    0);
	assert_int_equal(type, ECX_MC_HS_CONNECTION);
	assert_int_equal(jl, 0);
	assert_int_equal(
	    ecx_mc_hs_body_decode(conn, 0, &type, &json, &jl, why, sizeof(why)),
	    ECX_EPROTO);
	size_t n;
	assert_null(ecx_mc_hs_frame_encode(1, "x", ECX_MC_HS_MAX, &n));
}

/* src/transfer_metadata.cpp encodeSegmentDesc() for protocol "tcp", as
 * jsoncpp's FastWriter prints it (members sorted by key, no spaces, a
 * newline at the end); tcp_transport.cpp allocateLocalSegmentID() and
 * registerLocalMemory() name the segment and each buffer with the session
 * name and advertise tcp_proto_version 2. */
#define SEG_FIXTURE                                                         \
	"{\"buffers\":[{\"addr\":140245119590400,\"length\":67108864,"      \
	"\"name\":\"127.0.0.1:15123\"},{\"addr\":94512775536640,"           \
	"\"length\":4096,\"name\":\"127.0.0.1:15123\"}],\"name\":"          \
	"\"127.0.0.1:15123\",\"protocol\":\"tcp\",\"tcp_data_port\":16042," \
	"\"tcp_proto_version\":2,\"timestamp\":\"2026-12-01 18:31:24."      \
	"123456\"}\n"

static void test_segment_bytes(void **state)
{
	(void)state;
	ecx_mc_buffer b[2] = {
	    {"127.0.0.1:15123", 140245119590400ull, 67108864},
	    {"127.0.0.1:15123", 94512775536640ull, 4096},
	};
	ecx_mc_segment s;
	memset(&s, 0, sizeof(s));
	strcpy(s.name, "127.0.0.1:15123");
	s.tcp_data_port = 16042;
	s.tcp_proto_version = 2;
	strcpy(s.timestamp, "2026-12-01 18:31:24.123456");
	s.n_buffers = 2;
	s.buffers = b;
	size_t n = 0;
	char *txt = ecx_mc_segment_encode(&s, &n);
	assert_non_null(txt);
	assert_string_equal(txt, SEG_FIXTURE);
	assert_int_equal(n, strlen(SEG_FIXTURE));
	free(txt);

	ecx_mc_segment d;
	char why[160] = "";
	assert_int_equal(ecx_mc_segment_decode(SEG_FIXTURE, strlen(SEG_FIXTURE),
	                                       &d, why, sizeof(why)),
	                 0);
	assert_string_equal(d.name, "127.0.0.1:15123");
	assert_int_equal(d.tcp_data_port, 16042);
	assert_int_equal(d.tcp_proto_version, 2);
	assert_string_equal(d.timestamp, "2026-12-01 18:31:24.123456");
	assert_int_equal(d.n_buffers, 2);
	assert_int_equal(d.buffers[0].addr, 140245119590400ull);
	assert_int_equal(d.buffers[0].length, 67108864);
	assert_string_equal(d.buffers[1].name, "127.0.0.1:15123");
	assert_int_equal(d.buffers[1].addr, 94512775536640ull);
	assert_int_equal(ecx_mc_segment_find(&d, 94512775536640ull, 4096), 1);
	assert_int_equal(ecx_mc_segment_find(&d, 94512775536641ull, 4096), -1);
	assert_int_equal(
	    ecx_mc_segment_find(&d, 140245119590400ull + 67108863, 1), 0);
	assert_int_equal(
	    ecx_mc_segment_find(&d, 140245119590400ull + 67108863, 2), -1);
	ecx_mc_segment_free(&d);
	ecx_mc_segment_free(&d);

	/* A fresh timestamp is local time "YYYY-MM-DD HH:MM:SS.uuuuuu". */
	s.timestamp[0] = '\0';
	s.n_buffers = 0;
	txt = ecx_mc_segment_encode(&s, &n);
	assert_non_null(txt);
	const char *ts = strstr(txt, "\"timestamp\":\"");
	assert_non_null(ts);
	ts += strlen("\"timestamp\":\"");
	assert_int_equal(strcspn(ts, "\""), 26);
	assert_int_equal(ts[4], '-');
	assert_int_equal(ts[10], ' ');
	assert_int_equal(ts[19], '.');
	assert_non_null(strstr(txt, "{\"buffers\":[],\"name\":"));
	free(txt);
}

static int dec(const char *j, char *why)
{
	ecx_mc_segment d;
	int rc = ecx_mc_segment_decode(j, strlen(j), &d, why, 160);
	if (rc == 0)
		ecx_mc_segment_free(&d);
	return rc;
}

#define SEG_HEAD "{\"name\":\"h:1\",\"protocol\":\"tcp\",\"tcp_data_port\":2"

/* src/transfer_metadata.cpp decodeSegmentDesc(): a buffer with an empty
 * name, or a zero addr or length, refuses the whole descriptor; a missing
 * tcp_proto_version is 1; protocols other than tcp are another
 * transport. The rest are ecx's own refusals (frame.h lists them). */
static void test_segment_refusals(void **state)
{
	(void)state;
	char why[160];
	ecx_mc_segment d;
	const char *v1 = SEG_HEAD "}";
	assert_int_equal(ecx_mc_segment_decode(v1, strlen(v1), &d, why, 160),
	                 0);
	assert_int_equal(d.tcp_proto_version, 1);
	assert_int_equal(d.n_buffers, 0);
	assert_null(d.buffers);
	ecx_mc_segment_free(&d);

	assert_int_equal(dec(SEG_HEAD ",\"buffers\":[{\"name\":\"\",\"addr\":1,"
	                              "\"length\":1}]}",
	                     why),
	                 ECX_EPROTO);
	assert_non_null(strstr(why, "no name"));
	assert_int_equal(dec(SEG_HEAD
	                     ",\"buffers\":[{\"name\":\"a\",\"addr\":1,"
	                     "\"length\":1},{\"name\":\"b\",\"addr\":0,"
	                     "\"length\":1}]}",
	                     why),
	                 ECX_EPROTO);
	assert_non_null(strstr(why, "buffer 1 has a zero addr"));
	assert_int_equal(dec(SEG_HEAD ",\"buffers\":[{\"name\":\"a\",\"addr\":"
	                              "1,\"length\":0}]}",
	                     why),
	                 ECX_EPROTO);
	assert_int_equal(dec(SEG_HEAD ",\"buffers\":[{\"name\":\"a\",\"addr\":"
	                              "1}]}",
	                     why),
	                 ECX_EPROTO);
	assert_int_equal(dec(SEG_HEAD ",\"buffers\":[{\"name\":\"a\",\"addr\":"
	                              "9007199254740992,\"length\":1}]}",
	                     why),
	                 ECX_EPROTO);
	assert_int_equal(dec(SEG_HEAD ",\"buffers\":[{\"name\":\"a\",\"addr\":"
	                              "-4096,\"length\":1}]}",
	                     why),
	                 ECX_EPROTO);
	assert_int_equal(dec(SEG_HEAD ",\"buffers\":{}}", why), ECX_EPROTO);
	assert_int_equal(dec(SEG_HEAD ",\"buffers\":[7]}", why), ECX_EPROTO);
	assert_int_equal(dec(SEG_HEAD ",\"tcp_proto_version\":256}", why),
	                 ECX_EPROTO);
	assert_int_equal(dec(SEG_HEAD ",\"timestamp\":5}", why), ECX_EPROTO);

	assert_int_equal(dec("{\"name\":\"h:1\",\"protocol\":\"rdma\","
	                     "\"tcp_data_port\":2}",
	                     why),
	                 ECX_EUNSUPPORTED);
	assert_int_equal(dec("{\"name\":\"h:1\",\"protocol\":[\"cxl\",\"tcp\"],"
	                     "\"tcp_data_port\":2}",
	                     why),
	                 ECX_EUNSUPPORTED);
	assert_int_equal(dec("{\"name\":\"h:1\",\"tcp_data_port\":2}", why),
	                 ECX_EPROTO);
	assert_int_equal(
	    dec("{\"name\":\"h:1\",\"protocol\":\"tcp\",\"tcp_data_port\":0}",
	        why),
	    ECX_EPROTO);
	assert_int_equal(
	    dec("{\"name\":\"h:1\",\"protocol\":\"tcp\",\"tcp_data_port\":"
	        "65536}",
	        why),
	    ECX_EPROTO);
	assert_int_equal(dec("{\"name\":\"h\",\"protocol\":\"tcp\","
	                     "\"tcp_data_port\":2}",
	                     why),
	                 ECX_EPROTO);
	assert_int_equal(dec("{\"protocol\":\"tcp\",\"tcp_data_port\":2}", why),
	                 ECX_EPROTO);
	assert_int_equal(dec("[1,2]", why), ECX_EPROTO);
	assert_int_equal(dec("{\"name\":", why), ECX_EPROTO);
	assert_int_equal(dec("", why), ECX_EPROTO);
}

static void test_host_port(void **state)
{
	(void)state;
	char host[64], why[160];
	uint16_t port = 0;
	assert_int_equal(ecx_mc_host_port("127.0.0.1:15001", host, sizeof(host),
	                                  &port, why, sizeof(why)),
	                 0);
	assert_string_equal(host, "127.0.0.1");
	assert_int_equal(port, 15001);
	assert_int_equal(ecx_mc_host_port("[::1]:65535", host, sizeof(host),
	                                  &port, why, sizeof(why)),
	                 0);
	assert_string_equal(host, "::1");
	assert_int_equal(port, 65535);
	assert_int_equal(ecx_mc_host_port("node-3.example:80", host,
	                                  sizeof(host), &port, why,
	                                  sizeof(why)),
	                 0);
	assert_string_equal(host, "node-3.example");
	const char *bad[] = {"",        "host",     "host:", ":80",    "h:0",
	                     "h:65536", "h:123456", "h:8x",  "::1:80", "[::1]",
	                     "[::1]80", "[]:80",    "h:-1"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		assert_int_equal(ecx_mc_host_port(bad[i], host, sizeof(host),
		                                  &port, why, sizeof(why)),
		                 ECX_EINVAL);
	char small[4];
	assert_int_equal(ecx_mc_host_port("abcd:1", small, sizeof(small), &port,
	                                  why, sizeof(why)),
	                 ECX_EINVAL);
}

/* src/transport/tcp_transport/tcp_transport_session_impl.h: struct
 * SessionHeader {u64 size; u64 addr; u8 opcode;} is 24 bytes on the wire
 * (7 bytes of padding), size and addr little-endian (htole64);
 * TransferRequest::READ 0, WRITE 1, kOpcodeV2Flag 0x80. */
static void test_hdr_bytes(void **state)
{
	(void)state;
	ecx_mc_hdr h = {.size = 65536,
	                .addr = 0x00007f0012345000ull,
	                .opcode = ECX_MC_OP_WRITE | ECX_MC_OP_V2};
	uint8_t out[ECX_MC_HDR_LEN];
	memset(out, 0xaa, sizeof(out));
	ecx_mc_hdr_encode(&h, out);
	static const uint8_t want[24] = {
	    0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, /* size */
	    0x00, 0x50, 0x34, 0x12, 0x00, 0x7f, 0x00, 0x00, /* addr */
	    0x81, 0,    0,    0,    0,    0,    0,    0};
	assert_memory_equal(out, want, sizeof(want));

	/* Padding is ignored on the way in; 2^63 bytes is decoded as is
	 * (the receiver refuses it, not the codec). */
	uint8_t in[24] = {0,    0,    0,    0,    0,    0,    0,    0x80,
	                  1,    0,    0,    0,    0,    0,    0,    0,
	                  0x01, 0xde, 0xad, 0xbe, 0xef, 0xde, 0xad, 0xbe};
	ecx_mc_hdr d;
	ecx_mc_hdr_decode(in, &d);
	assert_int_equal(d.size, 1ull << 63);
	assert_int_equal(d.addr, 1);
	assert_true(ecx_mc_hdr_is_write(&d));
	assert_false(ecx_mc_hdr_v2(&d));
	/* Any opcode but WRITE is served as READ by Mooncake's server. */
	d.opcode = 0x80;
	assert_false(ecx_mc_hdr_is_write(&d));
	assert_true(ecx_mc_hdr_v2(&d));
	d.opcode = 0x07;
	assert_false(ecx_mc_hdr_is_write(&d));
	d.opcode = 0x81;
	assert_true(ecx_mc_hdr_is_write(&d));
}

/* Same file: kStatusMagic 0x4D435456 << 32 ("MCTV"), kStatusOk magic|0,
 * kStatusAddrRejected magic|1, sent htole64; statusFrameValid() checks
 * the high half. */
static void test_status_bytes(void **state)
{
	(void)state;
	uint8_t out[8];
	ecx_mc_status_encode(ECX_MC_STATUS_OK, out);
	static const uint8_t ok[8] = {0, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d};
	assert_memory_equal(out, ok, 8);
	ecx_mc_status_encode(ECX_MC_STATUS_REJECTED, out);
	static const uint8_t rej[8] = {1, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d};
	assert_memory_equal(out, rej, 8);
	assert_true(ecx_mc_status_decode(ok) == ECX_MC_STATUS_OK);
	assert_true(ecx_mc_status_decode(rej) == ECX_MC_STATUS_REJECTED);
	assert_true(ecx_mc_status_valid(ECX_MC_STATUS_REJECTED));
	static const uint8_t junk[8] = {0, 0, 0, 0, 0x56, 0x54, 0x43, 0x4e};
	assert_false(ecx_mc_status_valid(ecx_mc_status_decode(junk)));
}

static void test_range(void **state)
{
	(void)state;
	assert_true(ecx_mc_range_within(100, 10, 100, 10));
	assert_false(ecx_mc_range_within(100, 11, 100, 10));
	assert_false(ecx_mc_range_within(99, 1, 100, 10));
	assert_false(ecx_mc_range_within(100, 0, 100, 10));
	assert_false(ecx_mc_range_within(UINT64_MAX, 2, 100, UINT64_MAX));
	assert_false(ecx_mc_range_within(104, 1ull << 63, 100, 10));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_hs_probe_bytes),
	    cmocka_unit_test(test_hs_refusals),
	    cmocka_unit_test(test_segment_bytes),
	    cmocka_unit_test(test_segment_refusals),
	    cmocka_unit_test(test_host_port),
	    cmocka_unit_test(test_hdr_bytes),
	    cmocka_unit_test(test_status_bytes),
	    cmocka_unit_test(test_range),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
