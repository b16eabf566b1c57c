/* Included after <linux/fuse.h> into a compile of fanfs's C (tests/sanitizers/test_sanitizers.py): every
 * name linux/fuse.h gained after protocol 7.27 is poisoned, so that C using one fails here as
 * it would on RHEL 8 (kernel 4.18, whose headers stop at 7.27). The kernels fanfs runs on are
 * listed in docs/environment.md ("Kernels"). Names only in comments do not count. */
#pragma GCC system_header /* (poisoning names the header defined: no warning each) */
#include <linux/fuse.h>
#pragma GCC poison FUSE_COPY_FILE_RANGE FOPEN_CACHE_DIR FUSE_MAX_PAGES max_pages
#pragma GCC poison FUSE_CACHE_SYMLINKS FUSE_NO_OPENDIR_SUPPORT FUSE_EXPLICIT_INVAL_DATA
#pragma GCC poison FUSE_IOCTL_COMPAT_X32 FUSE_WRITE_KILL_PRIV FUSE_SETUPMAPPING
#pragma GCC poison FUSE_REMOVEMAPPING map_alignment FUSE_MAP_ALIGNMENT FUSE_ATTR_SUBMOUNT
#pragma GCC poison FUSE_SUBMOUNTS FUSE_HANDLE_KILLPRIV_V2 FUSE_WRITE_KILL_SUIDGID
#pragma GCC poison FATTR_KILL_SUIDGID FUSE_OPEN_KILL_SUIDGID FUSE_SETXATTR_EXT
#pragma GCC poison FUSE_SETXATTR_ACL_KILL_SGID FUSE_SYNCFS FOPEN_NOFLUSH FUSE_INIT_EXT flags2
#pragma GCC poison FUSE_SECURITY_CTX FUSE_HAS_INODE_DAX FUSE_ATTR_DAX FUSE_TMPFILE
#pragma GCC poison FUSE_EXPIRE_ONLY FOPEN_PARALLEL_DIRECT_WRITES total_extlen
#pragma GCC poison FUSE_MAX_NR_SECCTX fuse_secctx fuse_secctx_header fuse_ext_header
