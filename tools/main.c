/* main.c - the ecx command: dispatches to subcommands (the shared helpers
 * are in opts.c, net.c and util.c). */
#include "tool.h"

#include <stdlib.h>
#include <string.h>

static const char usage[] =
    "usage: ecx COMMAND [OPTIONS]\n"
    "\n"
    "Moves multimodal encoder outputs between processes and hosts.\n"
    "\n"
    "Commands:\n"
    "  registry   run a standalone HTTP registry\n"
    "  serve      run a producer that publishes items (files or synthetic)\n"
    "  info       print one registry entry\n"
    "  ls         list a registry's entries\n"
    "  get        pull one item into a .npy file\n"
    "  consume    load every item a registry lists, and report throughput\n"
    "  bench      benchmarks: registry, transfer, file, all\n"
    "  demo       the main job: a producer and a consumer moving\n"
    "             encoder-shaped tensors, verified, beside a file baseline\n"
    "  version    print the version\n"
    "\n"
    "Run 'ecx COMMAND --help' for a command's options.\n"
    "Environment: ECX_TOKEN (default for --token), ECX_LOG (error, warn,\n"
    "info, debug; default warn), UCX_* (override ecx's UCX defaults),\n"
    "ECX_TCP_DATA, ECX_TCP_LANE, ECX_TCP_LANE_MIN, ECX_TCP_LANE_PORT (how\n"
    "data goes over TCP; docs/protocol.md, \"The data lane\").\n"
    "Exit codes: 0 success, 1 failure, 2 usage error, 3 id not found.\n";

int main(int argc, char **argv)
{
	if (argc < 2) {
		fputs(usage, stderr);
		return EXIT_USAGE;
	}
	const char *cmd = argv[1];
	if (strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 ||
	    strcmp(cmd, "help") == 0) {
		fputs(usage, stdout);
		return EXIT_OK;
	}
	if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
		printf("ecx %s\n", ecx_version());
		return EXIT_OK;
	}
	static const struct {
		const char *name;
		int (*fn)(int, char **);
	} cmds[] = {{"registry", cmd_registry}, {"serve", cmd_serve},
	            {"info", cmd_info},         {"ls", cmd_ls},
	            {"get", cmd_get},           {"bench", cmd_bench},
	            {"demo", cmd_demo},         {"consume", cmd_consume}};
	/* Commands that report their own failures in one line keep the
	 * library's warnings (a registry it will retry, ...) to themselves;
	 * the daemons log them. ECX_LOG overrides both. */
	bool daemon = strcmp(cmd, "registry") == 0 || strcmp(cmd, "serve") == 0;
	/* The library reads ECX_LOG once, at its first message. */
	if (getenv("ECX_LOG") == NULL) {
		setenv("ECX_LOG", daemon ? "warn" : "error", 1);
		tool_log_defaulted = true;
	}
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
		if (strcmp(cmd, cmds[i].name) == 0) {
			/* getopt names the program in its messages: "ecx get:
			 * unrecognized option", like every other message. */
			static char name[32];
			snprintf(name, sizeof(name), "ecx %s", cmds[i].name);
			argv[1] = name;
			return cmds[i].fn(argc - 1, argv + 1);
		}
	}
	fprintf(stderr, "ecx: unknown command '%s'\n\n%s", cmd, usage);
	return EXIT_USAGE;
}
