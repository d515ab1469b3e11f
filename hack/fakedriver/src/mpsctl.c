/* nvidia-cuda-mps-control stand-in over the fake libnvidia-ml.so.1: the control daemon of CUDA MPS
 * and its client, speaking the commands gpu-sharing uses.
 *
 * What NVIDIA's tool does (man page nvidia-cuda-mps-control(1),
 * https://manpages.ubuntu.com/manpages/noble/man1/nvidia-cuda-mps-control.1.html, and the MPS
 * guide, https://docs.nvidia.com/deploy/mps/latest/): `-d` starts the control daemon in the
 * background; without arguments the tool is a client that reads commands from stdin, one a line,
 * sends each to the daemon whose pipes are in $CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps)
 * and prints its answers. The daemon logs to $CUDA_MPS_LOG_DIRECTORY/control.log (default
 * /var/log/nvidia-mps) and serves the GPUs in $CUDA_VISIBLE_DEVICES set before it started (UUIDs
 * recommended: "Appendix: Environment Variables"). Commands played:
 *   set_default_active_thread_percentage N    default for servers spawned after it
 *   get_default_active_thread_percentage      prints it as "25.0" (100.0 when never set)
 *   set_default_device_pinned_mem_limit D V   D: device index as the daemon sees it (0 with one
 *                                             visible GPU) or UUID; V: an integer with G or M
 *   get_default_device_pinned_mem_limit D     prints it as "3G" / "512M" ("0" when never set)
 *   get_server_list                           PIDs of the MPS servers, one a line
 *   get_client_list PID                       PIDs of the clients of server PID, one a line
 *                                             ("get_client_list <PID>": the MPS guide, "MPSv2
 *                                             Interface", https://docs.nvidia.com/deploy/mps/latest/mpsv2-interface.html)
 *   quit                                      the daemon and its servers exit
 * Output formats as NVIDIA's GPU operator documents them ("25.0", "3G": gpu-operator docs,
 * "Verify MPS").
 *
 * The fake's own parts: the control pipe is a unix socket `control` in the pipe directory, one
 * command per connection, each read as its bytes arrive (serve: a connection that sends nothing
 * holds up no other). A process stands for a CUDA client by connecting and sending
 * `fake_attach` and keeping the connection open (its PID from SO_PEERCRED); the daemon then runs one
 * MPS server (a child process), as the real daemon launches nvidia-cuda-mps-server when the first
 * client connects ("created on-demand when client applications connect", MPS guide, "Server",
 * https://docs.nvidia.com/deploy/topics/topic_5_1_2.html). The server stays when its last client
 * has gone, until `quit` or the daemon's end: NVIDIA documents a server shutting down once its
 * clients are done only when a client of another user waits for it (man page, "DESCRIPTION"),
 * never for an idle one, so an idle server is a compute process of its device as a busy one is. What the daemon was told, its server and
 * its clients are written to <state dir>/mps/<daemon pid>.json (replaced by rename), the record the
 * fake libnvidia-ml reads (compute processes of the GPU, MPS processes) and tests read the limits
 * from. The daemon holds an exclusive flock on <daemon pid>.lock for its life: a record whose lock
 * can be taken belongs to a daemon that is gone (killed), whatever PID namespace the reader is in.
 * Test hook: while <state dir>/mps/refuse-start exists, `-d` fails (a daemon that cannot start).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nvml.h"

#define MAX_CLIENTS 64
#define MAX_GPUS 16
#define BUF 8192

static char pipe_dir[PATH_MAX], log_dir[PATH_MAX], record_dir[PATH_MAX];
static char gpus[MAX_GPUS][NVML_DEVICE_UUID_V2_BUFFER_SIZE];
static int ngpus;
static int thread_pct = -1;
static long long pinned_mib[MAX_GPUS];
static pid_t server_pid;
static int clients[MAX_CLIENTS];
static pid_t client_pids[MAX_CLIENTS];
static int nclients;
static FILE *logf;

static const char *env_or(const char *name, const char *fallback)
{
	const char *v = getenv(name);
	return v && *v ? v : fallback;
}

static void mkdirs(const char *path)
{
	char buf[PATH_MAX];
	snprintf(buf, sizeof buf, "%s", path);
	for (char *p = buf + 1; *p; p++)
		if (*p == '/') {
			*p = '\0';
			mkdir(buf, 0755);
			*p = '/';
		}
	mkdir(buf, 0755);
}

/* The fake driver's state directory: dirname($FAKE_NVML_STATE), else <root>/var/lib/fake-nvidia
 * where <root> holds this binary as <root>/usr/bin/ (the library's own rule, hack/fakedriver/README.md). */
static void find_record_dir(void)
{
	const char *state = getenv("FAKE_NVML_STATE");
	char dir[PATH_MAX];
	if (state && *state) {
		snprintf(dir, sizeof dir, "%s", state);
		char *slash = strrchr(dir, '/');
		if (slash)
			*slash = '\0';
		else
			snprintf(dir, sizeof dir, ".");
	} else {
		char exe[PATH_MAX];
		ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
		exe[n > 0 ? n : 0] = '\0';
		char *slash = strrchr(exe, '/');
		if (slash)
			*slash = '\0';
		size_t len = strlen(exe), tail = strlen("/usr/bin");
		if (len >= tail && strcmp(exe + len - tail, "/usr/bin") == 0)
			exe[len - tail] = '\0';
		snprintf(dir, sizeof dir, "%s/var/lib/fake-nvidia", exe);
	}
	snprintf(record_dir, sizeof record_dir, "%s/mps", dir);
}

static int control_address(struct sockaddr_un *addr)
{
	memset(addr, 0, sizeof *addr);
	addr->sun_family = AF_UNIX;
	int n = snprintf(addr->sun_path, sizeof addr->sun_path, "%s/control", pipe_dir);
	return n > 0 && (size_t)n < sizeof addr->sun_path ? 0 : -1;
}

static int connect_control(void)
{
	struct sockaddr_un addr;
	if (control_address(&addr) != 0)
		return -1;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
		close(fd);
		return -1;
	}
	return fd;
}

/* ---- the client ---------------------------------------------------------------------------- */

static int client_main(void)
{
	char line[BUF];
	int status = 0;
	while (fgets(line, sizeof line, stdin)) {
		line[strcspn(line, "\r\n")] = '\0';
		if (!*line)
			continue;
		int fd = connect_control();
		if (fd < 0) {
			/* the real client's words when no daemon listens on the pipe directory */
			fprintf(stderr, "Cannot find MPS control daemon process\n");
			return 1;
		}
		if (write(fd, line, strlen(line)) < 0 || shutdown(fd, SHUT_WR) != 0) {
			close(fd);
			return 1;
		}
		char reply[BUF];
		ssize_t n;
		while ((n = read(fd, reply, sizeof reply)) > 0)
			fwrite(reply, 1, (size_t)n, stdout);
		close(fd);
		fflush(stdout);
	}
	return status;
}

/* ---- the daemon ---------------------------------------------------------------------------- */

static void logline(const char *fmt, const char *arg)
{
	if (!logf)
		return;
	time_t now = time(NULL);
	struct tm tm;
	gmtime_r(&now, &tm);
	char stamp[32];
	strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &tm);
	fprintf(logf, "[%s.000 Control %d] ", stamp, (int)getpid());
	fprintf(logf, fmt, arg);
	fputc('\n', logf);
	fflush(logf);
}

static void write_json_string(FILE *f, const char *s)
{
	fputc('"', f);
	for (; *s; s++) {
		if (*s == '"' || *s == '\\')
			fputc('\\', f);
		if ((unsigned char)*s >= 0x20)
			fputc(*s, f);
	}
	fputc('"', f);
}

/* The record the fake libnvidia-ml reads: written whole, then renamed over the last one. */
static void write_record(void)
{
	char path[PATH_MAX + 32], tmp[PATH_MAX + 32];
	snprintf(path, sizeof path, "%s/%d.json", record_dir, (int)getpid());
	snprintf(tmp, sizeof tmp, "%s/.%d.json.tmp", record_dir, (int)getpid());
	FILE *f = fopen(tmp, "w");
	if (!f)
		return;
	fprintf(f, "{\"pid\":%d,\"pipeDirectory\":", (int)getpid());
	write_json_string(f, pipe_dir);
	fprintf(f, ",\"logDirectory\":");
	write_json_string(f, log_dir);
	fprintf(f, ",\"gpus\":[");
	for (int i = 0; i < ngpus; i++) {
		fprintf(f, "%s", i ? "," : "");
		write_json_string(f, gpus[i]);
	}
	fprintf(f, "],\"activeThreadPercentage\":");
	if (thread_pct < 0)
		fprintf(f, "null");
	else
		fprintf(f, "%d", thread_pct);
	fprintf(f, ",\"pinnedMemLimitMiB\":[");
	for (int i = 0; i < ngpus; i++) {
		fprintf(f, "%s", i ? "," : "");
		if (pinned_mib[i] < 0)
			fprintf(f, "null");
		else
			fprintf(f, "%lld", pinned_mib[i]);
	}
	fprintf(f, "],\"serverPid\":%d,\"clients\":[", (int)server_pid);
	for (int i = 0; i < nclients; i++)
		fprintf(f, "%s%d", i ? "," : "", (int)client_pids[i]);
	fprintf(f, "]}\n");
	if (fclose(f) == 0)
		rename(tmp, path);
}

static void remove_record(void)
{
	char path[PATH_MAX + 32];
	snprintf(path, sizeof path, "%s/%d.json", record_dir, (int)getpid());
	unlink(path);
	snprintf(path, sizeof path, "%s/%d.lock", record_dir, (int)getpid());
	unlink(path);
}

static void stop_server(void)
{
	if (server_pid > 0) {
		kill(server_pid, SIGKILL);
		waitpid(server_pid, NULL, 0);
		logline("Server %s exited", "");
		server_pid = 0;
		write_record(); /* before the pipe goes: a daemon that no longer answers has no server */
	}
}

/* The MPS server: spawned for the first client, gone with the daemon (an idle one stays).
 *
 * The child shares every descriptor of the daemon (O_CLOEXEC closes them at exec, and it never
 * execs), and a flock belongs to the open file, not to a process ("Locks created by flock() are
 * associated with an open file description ... duplicate file descriptors (created by, for example,
 * fork(2) or dup(2)) refer to the same lock", flock(2), https://man7.org/linux/man-pages/man2/flock.2.html).
 * So it closes them all first: a server left holding the lock would make a killed daemon's record
 * look alive, and one holding the listener would take connections that nobody answers.
 * PR_SET_PDEATHSIG kills it with the daemon, but "If the parent thread ... [has] already terminated
 * by the time of the PR_SET_PDEATHSIG operation, then no parent-death signal is sent" (prctl(2),
 * https://man7.org/linux/man-pages/man2/prctl.2.html): a daemon killed between fork and prctl
 * would leave it for ever, so it leaves when its parent is no longer the daemon. */
static void start_server(void)
{
	if (server_pid > 0)
		return;
	pid_t daemon_pid = getpid();
	pid_t pid = fork();
	if (pid == 0) {
		closefrom(3);
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != daemon_pid)
			_exit(0);
		for (;;)
			pause();
	}
	if (pid > 0) {
		server_pid = pid;
		logline("Starting new server for user %s", "root");
	}
}

/* A device as the daemon numbers it: an index among its visible GPUs, or a UUID of one. */
static int device_of(const char *name)
{
	for (int i = 0; i < ngpus; i++)
		if (strcmp(name, gpus[i]) == 0)
			return i;
	char *end;
	long n = strtol(name, &end, 10);
	return *name && !*end && n >= 0 && n < ngpus ? (int)n : -1;
}

static void format_mib(char *out, size_t size, long long mib)
{
	if (mib > 0 && mib % 1024 == 0)
		snprintf(out, size, "%lldG\n", mib / 1024);
	else
		snprintf(out, size, "%lldM\n", mib);
}

/* One command; its answer in `out`; 1 when the daemon is to quit. */
static int command(char *line, char *out, size_t size)
{
	char *words[4] = {0};
	int n = 0;
	for (char *save = NULL, *w = strtok_r(line, " \t", &save); w && n < 4; w = strtok_r(NULL, " \t", &save))
		words[n++] = w;
	out[0] = '\0';
	if (n == 0)
		return 0;
	logline("Received command: %s", words[0]);
	if (strcmp(words[0], "quit") == 0 && n == 1)
		return 1;
	if (strcmp(words[0], "get_server_list") == 0 && n == 1) {
		if (server_pid > 0)
			snprintf(out, size, "%d\n", (int)server_pid);
		return 0;
	}
	if (strcmp(words[0], "get_client_list") == 0 && n == 2) {
		char *end;
		long pid = strtol(words[1], &end, 10);
		if (*end || pid <= 0 || pid != server_pid) {
			snprintf(out, size, "Invalid server PID %s\n", words[1]);
			return 0;
		}
		size_t used = 0;
		for (int i = 0; i < nclients && used < size; i++)
			used += (size_t)snprintf(out + used, size - used, "%d\n", (int)client_pids[i]);
		return 0;
	}
	if (strcmp(words[0], "get_default_active_thread_percentage") == 0 && n == 1) {
		snprintf(out, size, "%.1f\n", thread_pct < 0 ? 100.0 : (double)thread_pct);
		return 0;
	}
	if (strcmp(words[0], "set_default_active_thread_percentage") == 0 && n == 2) {
		char *end;
		long pct = strtol(words[1], &end, 10);
		if (*end || pct < 1 || pct > 100) {
			snprintf(out, size, "Invalid percentage %s\n", words[1]);
			return 0;
		}
		thread_pct = (int)pct;
		write_record();
		return 0;
	}
	if (strcmp(words[0], "get_default_device_pinned_mem_limit") == 0 && n == 2) {
		int dev = device_of(words[1]);
		if (dev < 0)
			snprintf(out, size, "Invalid device %s\n", words[1]);
		else if (pinned_mib[dev] < 0)
			snprintf(out, size, "0\n");
		else
			format_mib(out, size, pinned_mib[dev]);
		return 0;
	}
	if (strcmp(words[0], "set_default_device_pinned_mem_limit") == 0 && n == 3) {
		int dev = device_of(words[1]);
		char *end;
		long long v = strtoll(words[2], &end, 10);
		int unit = *end == 'G' ? 1024 : *end == 'M' ? 1 : 0;
		if (dev < 0 || v <= 0 || !unit || end[1]) {
			snprintf(out, size, "Invalid device or value: %s %s\n", words[1], words[2]);
			return 0;
		}
		pinned_mib[dev] = v * unit;
		write_record();
		return 0;
	}
	snprintf(out, size, "Unrecognized command %s\n", words[0]);
	return 0;
}

static void drop_client(int i)
{
	close(clients[i]);
	clients[i] = clients[nclients - 1];
	client_pids[i] = client_pids[nclients - 1];
	nclients--;
	write_record();
}

static volatile sig_atomic_t stopping;
static void on_term(int sig)
{
	(void)sig;
	stopping = 1;
}

/* Connections accepted whose command has not all arrived: each is read as its bytes come, from the
 * same poll as the rest, so a client that connects and sends nothing holds up no one. When all
 * MAX_PENDING are taken, the oldest is dropped for the newest. */
#define MAX_PENDING 16
static struct pending {
	int fd;
	size_t got;
	char line[BUF];
} pending[MAX_PENDING];
static int npending;

/* Out of the list, in order (the first is the oldest); its descriptor, for the caller to keep or close. */
static int take_pending(int i)
{
	int fd = pending[i].fd;
	memmove(pending + i, pending + i + 1, (size_t)(npending - i - 1) * sizeof *pending);
	npending--;
	return fd;
}

/* A command ends at EOF (the client shuts its side) or a newline; an attaching client keeps its
 * side open. */
static int complete(const struct pending *p)
{
	return memchr(p->line, '\n', p->got) || p->got == sizeof p->line - 1 ||
	       (p->got >= 11 && strncmp(p->line, "fake_attach", 11) == 0);
}

/* The pending connection's command, now whole; 1 when the daemon is to quit. */
static int answer(int i)
{
	char line[BUF];
	memcpy(line, pending[i].line, pending[i].got);
	line[pending[i].got] = '\0';
	line[strcspn(line, "\r\n")] = '\0';
	int fd = take_pending(i);
	if (strcmp(line, "fake_attach") == 0 && nclients < MAX_CLIENTS) {
		struct ucred cred;
		socklen_t len = sizeof cred;
		getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len);
		start_server();
		clients[nclients] = fd;
		client_pids[nclients++] = cred.pid;
		logline("Accepting connection from client %s", "");
		write_record();
		if (write(fd, "attached\n", 9) != 9)
			drop_client(nclients - 1);
		return 0;
	}
	char out[BUF];
	int quit = command(line, out, sizeof out);
	if (*out && write(fd, out, strlen(out)) < 0) {
		/* the client went away: nothing to answer (a short answer into the empty buffer of a
		 * fresh connection is written whole, even without blocking) */
	}
	close(fd);
	return quit;
}

/* 1 when the connection's command is whole (or it ended), 0 while more is to come. */
static int read_pending(struct pending *p)
{
	for (;;) {
		ssize_t r = read(p->fd, p->line + p->got, sizeof p->line - 1 - p->got);
		if (r > 0) {
			p->got += (size_t)r;
			if (complete(p))
				return 1;
			continue;
		}
		if (r == 0)
			return 1;
		return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
	}
}

static void serve(int listener)
{
	for (;;) {
		struct pollfd fds[1 + MAX_CLIENTS + MAX_PENDING];
		int nc = nclients, np = npending;
		fds[0] = (struct pollfd){.fd = listener, .events = POLLIN};
		for (int i = 0; i < nc; i++)
			fds[1 + i] = (struct pollfd){.fd = clients[i], .events = POLLIN};
		for (int i = 0; i < np; i++)
			fds[1 + nc + i] = (struct pollfd){.fd = pending[i].fd, .events = POLLIN};
		if (poll(fds, (nfds_t)(1 + nc + np), -1) < 0) {
			if (errno == EINTR && !stopping)
				continue;
			return;
		}
		/* Backwards: a drop moves later entries (already looked at) into the hole. */
		for (int i = nc - 1; i >= 0; i--)
			if (fds[1 + i].revents) { /* a client sends nothing more: any event is its end */
				logline("Client %s disconnected", "");
				drop_client(i);
			}
		for (int i = np - 1; i >= 0; i--) {
			if (!fds[1 + nc + i].revents)
				continue;
			int done = read_pending(&pending[i]);
			if (done < 0)
				close(take_pending(i));
			else if (done && answer(i))
				return;
		}
		if (!(fds[0].revents & POLLIN))
			continue;
		int fd = accept4(listener, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
		if (fd < 0)
			continue;
		if (npending == MAX_PENDING)
			close(take_pending(0));
		pending[npending++] = (struct pending){.fd = fd};
	}
}

static int fail(const char *what)
{
	fprintf(stderr, "%s\n", what);
	return 1;
}

/* The GPUs the daemon serves: $CUDA_VISIBLE_DEVICES (UUIDs or indices, comma separated) resolved
 * through NVML, else every GPU. */
static int resolve_gpus(void)
{
	if (nvmlInit_v2() != NVML_SUCCESS)
		return fail("nvidia-cuda-mps-control: NVML could not be initialised (no driver)");
	const char *visible = getenv("CUDA_VISIBLE_DEVICES");
	unsigned int count = 0;
	nvmlDeviceGetCount_v2(&count);
	char list[BUF];
	if (visible) {
		snprintf(list, sizeof list, "%s", visible);
	} else {
		list[0] = '\0';
		for (unsigned int i = 0; i < count; i++)
			snprintf(list + strlen(list), sizeof list - strlen(list), "%s%u", i ? "," : "", i);
	}
	for (char *save = NULL, *item = strtok_r(list, ",", &save); item && ngpus < MAX_GPUS;
	     item = strtok_r(NULL, ",", &save)) {
		nvmlDevice_t dev;
		char *end;
		long index = strtol(item, &end, 10);
		nvmlReturn_t rc = *item && !*end ? nvmlDeviceGetHandleByIndex_v2((unsigned int)index, &dev)
						 : nvmlDeviceGetHandleByUUID(item, &dev);
		if (rc != NVML_SUCCESS || nvmlDeviceGetUUID(dev, gpus[ngpus], sizeof gpus[ngpus]) != NVML_SUCCESS) {
			fprintf(stderr, "nvidia-cuda-mps-control: CUDA_VISIBLE_DEVICES names no GPU: %s\n", item);
			return 1;
		}
		pinned_mib[ngpus++] = -1;
	}
	nvmlShutdown();
	return ngpus ? 0 : fail("nvidia-cuda-mps-control: no CUDA-capable device is visible");
}

static int daemon_main(void)
{
	int probe = connect_control();
	if (probe >= 0) {
		close(probe);
		return fail("An instance of this daemon is already running");
	}
	find_record_dir();
	char hook[PATH_MAX + 16];
	snprintf(hook, sizeof hook, "%s/refuse-start", record_dir);
	if (access(hook, F_OK) == 0)
		return fail("nvidia-cuda-mps-control: the daemon could not start (fake driver: refuse-start)");
	if (resolve_gpus() != 0)
		return 1;
	mkdirs(pipe_dir);
	mkdirs(log_dir);
	mkdirs(record_dir);
	struct sockaddr_un addr;
	if (control_address(&addr) != 0)
		return fail("nvidia-cuda-mps-control: the pipe directory's path is too long");
	int ready[2];
	if (pipe2(ready, O_CLOEXEC) != 0)
		return fail("nvidia-cuda-mps-control: pipe failed");
	pid_t pid = fork();
	if (pid < 0)
		return fail("nvidia-cuda-mps-control: fork failed");
	if (pid > 0) { /* -d returns once the daemon serves, as the real one does */
		close(ready[1]);
		char ok = 0;
		ssize_t n = read(ready[0], &ok, 1);
		return n == 1 && ok == 'y' ? 0 : 1;
	}
	close(ready[0]);
	setsid();
	signal(SIGTERM, on_term);
	signal(SIGPIPE, SIG_IGN);
	char lock[PATH_MAX + 32];
	snprintf(lock, sizeof lock, "%s/%d.lock", record_dir, (int)getpid());
	int lock_fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
	if (lock_fd < 0 || flock(lock_fd, LOCK_EX) != 0)
		_exit(1);
	unlink(addr.sun_path);
	int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (listener < 0 || bind(listener, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(listener, 64) != 0)
		_exit(1);
	char logpath[PATH_MAX + 16];
	snprintf(logpath, sizeof logpath, "%s/control.log", log_dir);
	logf = fopen(logpath, "a");
	write_record();
	logline("Starting control daemon using socket %s", addr.sun_path);
	int devnull = open("/dev/null", O_RDWR);
	if (devnull >= 0) {
		dup2(devnull, 0);
		dup2(devnull, 1);
		dup2(devnull, 2);
	}
	if (write(ready[1], "y", 1) != 1)
		_exit(1);
	close(ready[1]);
	serve(listener);
	logline("Control daemon %s exiting", "");
	stop_server();
	unlink(addr.sun_path);
	remove_record();
	_exit(0);
}

int main(int argc, char **argv)
{
	snprintf(pipe_dir, sizeof pipe_dir, "%s", env_or("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"));
	snprintf(log_dir, sizeof log_dir, "%s", env_or("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"));
	if (argc == 2 && strcmp(argv[1], "-d") == 0)
		return daemon_main();
	if (argc == 1)
		return client_main();
	fprintf(stderr, "usage: nvidia-cuda-mps-control [-d]\n");
	return 1;
}
