#include "core/unix_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/errors.h"

namespace colomem {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x314D4C43;  // "CLM1" little-endian
constexpr size_t kHeaderBytes = 16;      // magic u32, nfds u32, length u64

class Deadline {
 public:
  explicit Deadline(double timeout_s) {
    require(std::isfinite(timeout_s) && timeout_s >= 0,
            cat("timeout must be a finite number of seconds >= 0, got ", timeout_s));
    end_ = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(std::min(timeout_s, 1e9) * 1e6));
  }
  int remaining_ms() const {
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(end_ - Clock::now()).count();
    if (left <= 0) return 0;
    return static_cast<int>(std::min<int64_t>((left + 999) / 1000, 1 << 30));
  }
  bool passed() const { return Clock::now() >= end_; }
  Clock::time_point end() const { return end_; }

 private:
  Clock::time_point end_;
};

// True when fd is ready for `events` (or has an error/hang-up to report) before the deadline.
bool wait_ready(int fd, short events, const Deadline& dl) {
  for (;;) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, dl.remaining_ms());
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) return true;  // let the following read/write report the error
  }
}

// The connection's send (or receive) lock, waited for no longer than the caller's own deadline: a thread
// blocked in a long poll on the same connection must not stretch another caller's timeout.
std::unique_lock<std::timed_mutex> lock_within(std::timed_mutex& mu, const Deadline& dl, double timeout_s,
                                               const std::string& peer, const char* what) {
  std::unique_lock<std::timed_mutex> lock(mu, std::defer_lock);
  if (!lock.try_lock_until(dl.end()))
    throw Timeout(cat("another thread was ", what, " on the connection to ", peer, " for all of the ",
                      cat(std::round(timeout_s * 1000.0) / 1000.0, " s"),
                      " allowed; wait again or give each thread its own connection"));
  return lock;
}

// Descriptor exhaustion: a pending connection that cannot be accepted keeps the listener readable, so
// polling again would spin. The caller sleeps instead.
bool out_of_descriptors(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }

void close_all(std::vector<int>& fds) {
  for (int f : fds) ::close(f);
  fds.clear();
}

// Closes received fds unless released (the message reached the caller).
struct FdGuard {
  std::vector<int>& fds;
  bool armed = true;
  ~FdGuard() {
    if (armed) close_all(fds);
  }
};

void collect_fds(msghdr& msg, std::vector<int>& out) {
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* data = CMSG_DATA(c);
    for (size_t i = 0; i < n; ++i) {
      int f;
      std::memcpy(&f, data + i * sizeof(int), sizeof(int));
      out.push_back(f);
    }
  }
}

std::string default_socket_base() {
  for (const char* var : {"XDG_RUNTIME_DIR", "TMPDIR"}) {
    const char* v = std::getenv(var);
    if (v && *v && ::access(v, W_OK | X_OK) == 0) return v;
  }
  return "/tmp";
}

// The owner's pid, so that a later bridge can tell a directory whose process died (SIGKILL, a crash) from
// one in use and remove it (colomem.bridge.socket_dir). Best effort: without it the directory is only kept.
void write_owner(const std::string& file) {
  int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return;
  std::string pid = cat(::getpid(), "\n");
  ssize_t n = ::write(fd, pid.data(), pid.size());
  (void)n;
  ::close(fd);
}

std::string fmt_seconds(double s) { return cat(std::round(s * 1000.0) / 1000.0, " s"); }

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// UnixConnection

UnixConnection::UnixConnection(int fd, std::string peer_role) : fd_(fd), peer_role_(std::move(peer_role)) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd_, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    int err = errno;
    ::close(fd_);
    throw PeerError(cat("cannot read the credentials of the ", peer_role_, " on the bridge socket: ",
                        std::strerror(err)));
  }
  peer_pid_ = cred.pid;
  peer_uid_ = cred.uid;
  if (cred.uid != ::geteuid()) {
    ::close(fd_);
    throw PeerError(cat("refused ", peer_role_, " process ", cred.pid, " of uid ", cred.uid,
                        ": only processes of uid ", ::geteuid(), " may attach to this bridge"));
  }
  int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags | O_NONBLOCK);
}

UnixConnection::~UnixConnection() { close(); }

std::unique_ptr<UnixConnection> UnixConnection::connect(const std::string& path, double timeout_s,
                                                        std::string peer_role) {
  Deadline dl(timeout_s);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  require(!path.empty() && path.size() < sizeof(addr.sun_path),
          cat("bridge socket path must be 1..", sizeof(addr.sun_path) - 1, " bytes, got '", path, "'"));
  std::memcpy(addr.sun_path, path.data(), path.size());
  for (;;) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) throw PeerError(cat("socket(AF_UNIX) failed: ", std::strerror(errno)));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0)
      return std::make_unique<UnixConnection>(fd, std::move(peer_role));
    int err = errno;
    if (err == EINPROGRESS) {  // not expected for AF_UNIX, but handled: wait and read the result
      if (wait_ready(fd, POLLOUT, dl)) {
        int so = 0;
        socklen_t len = sizeof(so);
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &len) == 0 && so == 0)
          return std::make_unique<UnixConnection>(fd, std::move(peer_role));
        err = so;
      } else {
        err = EAGAIN;
      }
    }
    ::close(fd);
    switch (err) {
      case EAGAIN:  // the listener's backlog is full: it exists but is busy
      case EINTR:
        if (dl.passed())
          throw Timeout(cat("could not connect to the bridge at ", path, " within ", fmt_seconds(timeout_s),
                            ": the ", peer_role, " is not accepting; raise the timeout or check that process"));
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      case ENOENT:
        throw PeerError(cat("no colomem bridge at ", path, ": the ", peer_role,
                            " closed it or exited (or the path is wrong)"));
      case ECONNREFUSED:
        throw PeerError(cat("nobody listens at ", path, ": the ", peer_role, " closed the bridge or exited"));
      case EACCES:
      case EPERM:
        throw PeerError(cat("permission denied connecting to ", path,
                            ": the bridge belongs to another user; only the same user may attach"));
      default:
        throw PeerError(cat("connect(", path, ") failed: ", std::strerror(err)));
    }
  }
}

std::string UnixConnection::peer_name() const { return cat(peer_role_, " process ", peer_pid_); }

int UnixConnection::fd_for_io(const char* what) const {
  if (closed()) throw PoolClosed(cat("cannot ", what, ": the connection to ", peer_name(), " was closed"));
  return fd_;
}

bool UnixConnection::closed() const {
  std::lock_guard<std::mutex> lock(close_mu_);
  return closed_;
}

void UnixConnection::fail_peer(const std::string& what, int err) {
  if (closed()) throw PoolClosed(cat("the connection to ", peer_name(), " was closed while ", what));
  // The stream position is lost: nothing more can be read or written on this connection.
  ::shutdown(fd_, SHUT_RDWR);
  if (err == 0)
    throw PeerError(cat(peer_name(), " closed the connection (it exited or crashed) while ", what));
  if (err == ECONNRESET || err == EPIPE)
    throw PeerError(cat(peer_name(), " died or reset the connection while ", what));
  throw PeerError(cat("connection to ", peer_name(), " failed while ", what, ": ", std::strerror(err)));
}

void UnixConnection::send(const std::string& data, const std::vector<int>& fds, double timeout_s) {
  Deadline dl(timeout_s);
  require(data.size() <= kMaxMessageBytes,
          cat("message of ", data.size(), " bytes exceeds the limit of ", kMaxMessageBytes));
  require(fds.size() <= kMaxFds, cat("at most ", kMaxFds, " file descriptors per message, got ", fds.size()));
  for (int f : fds) require(f >= 0, cat("invalid file descriptor ", f));
  auto lock = lock_within(send_mu_, dl, timeout_s, peer_name(), "sending");
  int fd = fd_for_io("send");

  unsigned char hdr[kHeaderBytes];
  uint32_t nfds = static_cast<uint32_t>(fds.size());
  uint64_t len = data.size();
  std::memcpy(hdr, &kMagic, 4);
  std::memcpy(hdr + 4, &nfds, 4);
  std::memcpy(hdr + 8, &len, 8);

  std::vector<unsigned char> control(fds.empty() ? 0 : CMSG_SPACE(fds.size() * sizeof(int)));
  size_t total = kHeaderBytes + data.size(), sent = 0;
  while (sent < total) {
    iovec iov[2];
    int niov = 0;
    if (sent < kHeaderBytes) iov[niov++] = {hdr + sent, kHeaderBytes - sent};
    size_t body_off = sent > kHeaderBytes ? sent - kHeaderBytes : 0;
    if (body_off < data.size())
      iov[niov++] = {const_cast<char*>(data.data()) + body_off, data.size() - body_off};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = niov;
    if (sent == 0 && !fds.empty()) {  // the descriptors travel with the first byte
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
      std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
    }
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    int err = errno;
    if (n < 0 && (err == EAGAIN || err == EWOULDBLOCK || err == EINTR)) {
      if (!wait_ready(fd, POLLOUT, dl)) {
        if (sent == 0)
          throw Timeout(cat(peer_name(), " did not take a message within ", fmt_seconds(timeout_s),
                            "; it may be stuck. Wait again or raise the timeout"));
        fail_peer(cat("sending a message (stalled after ", sent, " of ", total, " bytes)"), ETIMEDOUT);
      }
      continue;
    }
    fail_peer("sending a message", n == 0 ? EPIPE : err);
  }
}

SocketMessage UnixConnection::recv(double timeout_s) {
  Deadline dl(timeout_s);
  auto lock = lock_within(recv_mu_, dl, timeout_s, peer_name(), "receiving");
  int fd = fd_for_io("receive");
  SocketMessage out;
  FdGuard guard{out.fds};

  unsigned char hdr[kHeaderBytes];
  size_t got = 0;
  alignas(cmsghdr) unsigned char control[CMSG_SPACE(kMaxFds * sizeof(int))];
  while (got < kHeaderBytes) {
    iovec iov{hdr + got, kHeaderBytes - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n > 0) {
      collect_fds(msg, out.fds);
      if (msg.msg_flags & MSG_CTRUNC)
        fail_peer(cat("receiving a message (more than ", kMaxFds, " file descriptors)"), EPROTO);
      got += static_cast<size_t>(n);
      continue;
    }
    int err = errno;
    if (n < 0 && (err == EAGAIN || err == EWOULDBLOCK || err == EINTR)) {
      if (!wait_ready(fd, POLLIN, dl)) {
        if (got == 0)
          throw Timeout(cat("no message from ", peer_name(), " within ", fmt_seconds(timeout_s),
                            "; it may still be working: wait again or raise the timeout"));
        fail_peer("receiving a message (it stalled mid-message)", ETIMEDOUT);
      }
      continue;
    }
    fail_peer(got == 0 ? "waiting for a message" : "receiving a message", n == 0 ? 0 : err);
  }

  uint32_t magic, nfds;
  uint64_t len;
  std::memcpy(&magic, hdr, 4);
  std::memcpy(&nfds, hdr + 4, 4);
  std::memcpy(&len, hdr + 8, 8);
  if (magic != kMagic || nfds > kMaxFds || len > kMaxMessageBytes)
    fail_peer(cat("reading a message header (malformed: magic ", magic, ", ", nfds, " fds, ", len, " bytes)"),
              EPROTO);

  out.data.resize(len);
  size_t body = 0;
  while (body < len) {
    ssize_t n = ::recv(fd, &out.data[body], len - body, MSG_DONTWAIT);
    if (n > 0) {
      body += static_cast<size_t>(n);
      continue;
    }
    int err = errno;
    if (n < 0 && (err == EAGAIN || err == EWOULDBLOCK || err == EINTR)) {
      if (!wait_ready(fd, POLLIN, dl)) fail_peer("receiving a message (it stalled mid-message)", ETIMEDOUT);
      continue;
    }
    fail_peer("receiving a message", n == 0 ? 0 : err);
  }
  if (out.fds.size() != nfds)
    fail_peer(cat("receiving a message (announced ", nfds, " file descriptors, got ", out.fds.size(), ")"),
              EPROTO);
  guard.armed = false;
  return out;
}

void UnixConnection::close() {
  {
    std::lock_guard<std::mutex> lock(close_mu_);
    if (closed_) return;
    closed_ = true;
  }
  ::shutdown(fd_, SHUT_RDWR);  // wakes a send/recv blocked in poll in another thread
  std::lock_guard<std::timed_mutex> s(send_mu_);
  std::lock_guard<std::timed_mutex> r(recv_mu_);
  ::close(fd_);
}

// ---------------------------------------------------------------------------------------------------------
// UnixServer

UnixServer::UnixServer(const std::string& dir, const std::string& name) {
  require(!name.empty() && name.find('/') == std::string::npos, cat("invalid socket name '", name, "'"));
  std::string base = dir.empty() ? default_socket_base() : dir;
  sockaddr_un addr{};
  if (base.size() + name.size() + 16 >= sizeof(addr.sun_path)) {
    require(dir.empty(), cat("socket directory '", dir, "' is too long for a Unix socket path (",
                             sizeof(addr.sun_path) - 1, " bytes max); pick a shorter one"));
    base = "/tmp";
  }
  std::string tmpl = base + "/colomem-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr)  // mkdtemp creates the directory with mode 0700
    throw InvalidArgument(cat("cannot create a private directory under ", base, ": ", std::strerror(errno)));
  dir_ = buf.data();
  path_ = dir_ + "/" + name;
  owner_ = dir_ + "/" + kOwnerFile;
  write_owner(owner_);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path_.data(), path_.size());

  fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int err = 0;
  const char* step = "socket";
  if (fd_ < 0) {
    err = errno;
  } else if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    err = errno, step = "bind";
  } else if (::chmod(path_.c_str(), 0600) != 0) {
    err = errno, step = "chmod";
  } else if (::listen(fd_, 64) != 0) {
    err = errno, step = "listen";
  }
  if (err != 0) {
    if (fd_ >= 0) ::close(fd_);
    ::unlink(path_.c_str());
    ::unlink(owner_.c_str());
    ::rmdir(dir_.c_str());
    throw InvalidArgument(cat("cannot listen on ", path_, " (", step, "): ", std::strerror(err)));
  }
}

UnixServer::~UnixServer() { close(); }

bool UnixServer::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

std::unique_ptr<UnixConnection> UnixServer::accept(double timeout_s, std::string peer_role) {
  Deadline dl(timeout_s);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw PoolClosed(cat("the bridge socket ", path_, " was closed"));
    ++accepting_;
  }
  // The fd stays open while accepting_ > 0, so polling it outside the lock is safe; close() from another
  // thread shuts it down, which wakes the poll.
  struct Leave {
    UnixServer* s;
    ~Leave() {
      std::lock_guard<std::mutex> lock(s->mu_);
      if (--s->accepting_ == 0 && s->closed_) ::close(s->fd_);
    }
  } leave{this};
  for (;;) {
    if (closed()) throw PoolClosed(cat("the bridge socket ", path_, " was closed"));
    int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c >= 0) return std::make_unique<UnixConnection>(c, std::move(peer_role));
    int err = errno;
    if (out_of_descriptors(err)) {
      if (closed()) throw PoolClosed(cat("the bridge socket ", path_, " was closed"));
      if (dl.passed())
        throw PeerError(cat("accept on ", path_, " failed: ", std::strerror(err),
                            "; an importer is waiting. Close unused files or raise the limit (ulimit -n)"));
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, std::max(1, dl.remaining_ms()))));
      continue;
    }
    if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR && err != ECONNABORTED) {
      if (closed()) throw PoolClosed(cat("the bridge socket ", path_, " was closed"));
      throw PeerError(cat("accept on ", path_, " failed: ", std::strerror(err)));
    }
    if (!wait_ready(fd_, POLLIN, dl))
      throw Timeout(cat("no importer connected to ", path_, " within ", fmt_seconds(timeout_s)));
  }
}

void UnixServer::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;
  ::shutdown(fd_, SHUT_RDWR);
  if (accepting_ == 0) ::close(fd_);
  ::unlink(path_.c_str());
  ::unlink(owner_.c_str());
  ::rmdir(dir_.c_str());
}

}  // namespace colomem
