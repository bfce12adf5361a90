/* mask.c - registry URLs with their passwords masked, for every line
 * that may quote one: the library's log and the ecx command's output
 * (api/common.c makes it public as ecx_url_mask). */
#include "core.h"

#include <string.h>

/* The bytes that end a URL inside a line of text. */
static bool mask_url_end(char c)
{
	return c == '\0' || c == ' ' || c == '\t' || c == '\n' || c == '\'' ||
	       c == '"' || c == '(' || c == ')' || c == '<' || c == '>';
}

/* Whether a URL (SCHEME://) starts at p, after spaces: the comma before
 * it ends the URL before, in a list. */
static bool mask_starts_url(const char *p)
{
	while (*p == ' ')
		p++;
	size_t n = strspn(p, "abcdefghijklmnopqrstuvwxyz"
	                     "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-.");
	return n > 0 && strncmp(p + n, "://", 3) == 0;
}

void core_url_mask(const char *text, char *buf, size_t len)
{
	if (buf == NULL || len == 0)
		return;
	if (text == NULL)
		text = "";
	size_t o = 0;
	for (const char *p = text; *p != '\0';) {
		const char *sep = strstr(p, "://");
		if (sep == NULL) {
			o += ecx_strlcpy(buf + o, p, len - o);
			break;
		}
		/* Up to and with "://", as it is. */
		const char *auth = sep + 3;
		size_t n = (size_t)(auth - p);
		for (size_t i = 0; i < n && o + 1 < len; i++)
			buf[o++] = p[i];
		/* The URL's last '@' ends its user information: a password
		 * may hold '/', ',' or ':' (libecx reads redis://:PASSWORD@
		 * up to its '@'), so nothing of it is shown. */
		const char *end = auth, *at = NULL;
		while (!mask_url_end(*end) &&
		       !(*end == ',' && mask_starts_url(end + 1))) {
			if (*end == '@')
				at = end;
			end++;
		}
		p = auth;
		/* "[:password@]host", a usage message's notation, is no URL:
		 * no host starts with ']'. */
		if (at != NULL && at[1] != ']') {
			/* A user name before ':' stays; the rest is hidden. */
			const char *colon =
			    memchr(auth, ':', (size_t)(at - auth));
			const char *keep = colon != NULL ? colon + 1 : auth;
			for (const char *q = auth; q < keep && o + 1 < len; q++)
				buf[o++] = *q;
			for (const char *q = "***"; *q != '\0' && o + 1 < len;
			     q++)
				buf[o++] = *q;
			p = at;
		}
		if (o + 1 >= len)
			break;
	}
	buf[o < len ? o : len - 1] = '\0';
}
