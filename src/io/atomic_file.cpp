#include "dmuon/atomic_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dmuon/error.hpp"
#include "io/fault_injection.hpp"

namespace dmuon {

namespace {
void write_all(int fd, std::string_view bytes, const std::string& path) {
  size_t done = 0;
  if (fault::fail_write()) {
    errno = ENOSPC;
    DMUON_FAIL("cannot write ", path, ": ", std::strerror(errno));
  }
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    DMUON_CHECK(n > 0, "cannot write ", path, ": ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}
}  // namespace

void write_file_atomically(const std::string& path, std::string_view bytes) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::string tmp_name = ".";
  tmp_name += target.filename().string();
  tmp_name += ".tmp.XXXXXX";
  std::string tmp = (dir / tmp_name).string();
  int fd = ::mkstemp(tmp.data());
  DMUON_CHECK(fd >= 0, "cannot create a temporary file beside ", path, ": ", std::strerror(errno));
  try {
    write_all(fd, bytes, path);  // errors name the file being written, not its temporary
    DMUON_CHECK(::fsync(fd) == 0, "cannot fsync ", tmp, ": ", std::strerror(errno));
    DMUON_CHECK(::fchmod(fd, 0644) == 0, "cannot chmod ", tmp, ": ", std::strerror(errno));
    fault::point("wrote a temporary file");
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  try {
    rename_durably(tmp, path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

void rename_durably(const std::string& from, const std::string& to) {
  const std::filesystem::path target(to);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  DMUON_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename ", from, " to ", to, ": ", std::strerror(errno));
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  fault::point("renamed a file or folder");
}

std::string why_cannot_write(const std::string& path, bool folder) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path target(path);
  const fs::file_status status = fs::status(target, ec);
  if (fs::exists(status)) {
    if (folder && !fs::is_directory(status)) return path + " exists and is not a folder";
    if (!folder && !fs::is_regular_file(status)) return path + " exists and is not a regular file";
    if (::access(path.c_str(), W_OK) != 0) return path + " is not writable: " + std::strerror(errno);
  }
  // The nearest existing folder above: it receives the new file, the missing folders, or the renames.
  fs::path dir = target.parent_path();
  while (!dir.empty() && !fs::exists(dir, ec) && dir != dir.parent_path()) dir = dir.parent_path();
  if (dir.empty()) dir = ".";
  if (!fs::is_directory(dir, ec)) return dir.string() + " is not a folder";
  std::string probe = (dir / ".dmuon-write-check.XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) return "cannot create files in " + dir.string() + ": " + std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DMUON_CHECK(in.good(), "cannot open ", path, ": ", std::strerror(errno));
  std::ostringstream os;
  os << in.rdbuf();
  DMUON_CHECK(!in.bad(), "cannot read ", path);
  return os.str();
}

}  // namespace dmuon
