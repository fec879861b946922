// A Unix-domain stream socket that carries framed byte messages plus file descriptors (SCM_RIGHTS),
// between processes of the same user only. Host-only: compiled in both builds.
//
// Every wait is bounded (poll with a deadline). A timeout before any byte of a message arrived raises
// Timeout and leaves the connection usable; a peer that hangs up raises PeerError naming its pid; a
// timeout in the middle of a message closes the connection (the framing is lost) and raises PeerError.
// Threads sharing one connection take turns (one message at a time each way); a caller waiting for its turn
// waits no longer than its own timeout (Timeout, the connection stays usable).
#pragma once

#include <sys/types.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace colomem {

struct SocketMessage {
  std::string data;
  std::vector<int> fds;  // owned by the receiver (close-on-exec set)
};

class UnixConnection {
 public:
  // Takes ownership of a connected socket; checks the peer's credentials (same uid, else PeerError).
  // peer_role names the other side in error messages ("exporter", "importer").
  UnixConnection(int fd, std::string peer_role);
  ~UnixConnection();
  UnixConnection(const UnixConnection&) = delete;
  UnixConnection& operator=(const UnixConnection&) = delete;

  // Connects to a UnixServer's path. Retries while the listener's backlog is full, up to timeout_s.
  static std::unique_ptr<UnixConnection> connect(const std::string& path, double timeout_s,
                                                 std::string peer_role = "exporter");

  // fds are borrowed: the kernel duplicates them into the peer.
  void send(const std::string& data, const std::vector<int>& fds, double timeout_s);
  SocketMessage recv(double timeout_s);

  // Shuts the socket down (waking a blocked send/recv in another thread) and closes it. Idempotent.
  void close();
  bool closed() const;
  pid_t peer_pid() const { return peer_pid_; }
  uid_t peer_uid() const { return peer_uid_; }
  const std::string& peer_role() const { return peer_role_; }

  static constexpr size_t kMaxMessageBytes = 256ull << 20;
  static constexpr size_t kMaxFds = 64;

 private:
  int fd_for_io(const char* what) const;  // PoolClosed after close()
  [[noreturn]] void fail_peer(const std::string& what, int err);
  std::string peer_name() const;

  int fd_;
  pid_t peer_pid_ = 0;
  uid_t peer_uid_ = 0;
  std::string peer_role_;
  // Held for a whole send / recv (a message's framing), taken within the caller's deadline; close() shuts
  // the socket down (ending any poll) and takes both before ::close.
  std::timed_mutex send_mu_, recv_mu_;
  mutable std::mutex close_mu_;
  bool closed_ = false;
};

class UnixServer {
 public:
  // Creates a fresh 0700 directory (mkdtemp) under dir (default: $XDG_RUNTIME_DIR, $TMPDIR or /tmp) and
  // listens on <that directory>/<name> with mode 0600. The directory also holds kOwnerFile, this process's
  // pid: a directory whose owner died can be recognised and removed by the next bridge.
  static constexpr const char* kOwnerFile = "owner.pid";
  explicit UnixServer(const std::string& dir = "", const std::string& name = "bridge.sock");
  ~UnixServer();
  UnixServer(const UnixServer&) = delete;
  UnixServer& operator=(const UnixServer&) = delete;

  // Waits up to timeout_s for one connection (Timeout if none). A peer of another user is refused
  // (PeerError); the server stays usable. Out of file descriptors, it sleeps between tries (no spinning)
  // and raises PeerError saying so once timeout_s passed.
  std::unique_ptr<UnixConnection> accept(double timeout_s, std::string peer_role = "importer");
  const std::string& path() const { return path_; }
  // Stops listening, removes the socket file, the owner file and the directory. Idempotent.
  void close();
  bool closed() const;

 private:
  int fd_;
  std::string dir_, path_, owner_;
  mutable std::mutex mu_;
  bool closed_ = false;
  int accepting_ = 0;  // accept() calls in flight; the last one closes fd_ after close()
};

}  // namespace colomem
